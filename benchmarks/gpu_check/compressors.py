"""Check 3: every registered compressor, reducing through DataParallel on the device, against
the same compressor on the CPU with the same inputs.

The inputs are the same bit for bit: the model is ``loss = sum_i <p_i, x_i>``, whose gradient
is the input ``x`` itself on any device (a product with 1 and copies: nothing rounds), drawn
on the CPU. So the averaged gradients each step differ only by what the compressor computes
differently on the device. Halfway through, the compressor state is checkpointed and read
back with ``map_location="cpu"`` (what a resume on a CPU host, or any ``torch.load`` onto
the CPU, hands back) into a new DataParallel: CPU state must work beside device gradients.
So that the comparison is not vacuous, ``none`` must return its input exactly and every other
built-in compressor must change it.

Tolerances, as a fraction of the largest gradient entry, and why:
- none, fp16, bf16, topk: 0. Copies, casts (round to nearest even on every device) and a
  top-k of the same values; at world size 1 nothing is summed.
- csc: 1e-5. Momentum ``u = m*u + g`` may be fused (FMA) on one device and not the other,
  and chunk scores are sums of squares reduced in another order (a selection that flipped
  on such a near-tie would exceed the tolerance and fail the check).
- powersgd: 1e-3. Matrix products and the orthogonalisation round in another order, and
  error feedback carries those differences to the next step.
"""

from __future__ import annotations

import io
from typing import Any

import torch
from torch import nn

from benchmarks.gpu_check.common import (
    COMM_TIMEOUT_S,
    Record,
    backend_for,
    device_ids,
    rank_device,
    ranks,
)
from syncline import DataParallel
from syncline.dp.registry import COMPRESSORS, build_compressor

#: a spec for each built-in compressor: sizes that make it select, sparsify and compress
SPECS = {
    "none": "none",
    "fp16": "fp16",
    "bf16": "bf16",
    "csc": "csc:0.25:chunk=256",
    "topk": "topk:0.05",
    "powersgd": "powersgd:2",
}
TOLERANCE = {"csc": 1e-5, "powersgd": 1e-3}  # others: 0
STEPS, RESUME_AT = 4, 2
CAP_MB = 0.01  # ~2600 floats: the 6400 of the model fall in three buckets


class Exact(nn.Module):
    """``loss = <a, x_a> + <b, x_b> + <c, x_c>``: the gradient is ``x``, exactly, anywhere.
    ``a`` and ``b`` are matrices, so PowerSGD compresses them; ``c`` is a vector."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(64, 64))
        self.b = nn.Parameter(torch.zeros(64, 32))
        self.c = nn.Parameter(torch.zeros(256))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total, offset = x.new_zeros(()), 0
        for p in (self.a, self.b, self.c):
            total = total + (p * x[offset : offset + p.numel()].view_as(p)).sum()
            offset += p.numel()
        return total


def spec_for(name: str) -> str | None:
    """The spec this check runs for a registered compressor (``None``: a plug-in's that
    needs an argument this check cannot guess)."""
    if name in SPECS:
        return SPECS[name]
    entry = COMPRESSORS.get(name)
    return name if entry.argument is None else None


def _inputs(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(64 * 64 + 64 * 32 + 256, generator=g)


def _wrap(model: nn.Module, spec: str, dev: torch.device) -> DataParallel:
    return DataParallel(
        model,
        device_ids=device_ids(dev),
        compression=build_compressor(spec),
        bucket_cap_mb=CAP_MB,
        first_bucket_cap_mb=CAP_MB,
        timeout_s=COMM_TIMEOUT_S,
    )


def _grads_of(spec: str, dev: torch.device) -> list[torch.Tensor]:
    """The averaged gradient (flattened, on the CPU) of every step; the compressor's state
    goes through a CPU checkpoint at ``RESUME_AT``."""
    model = Exact().to(dev)
    dp = _wrap(model, spec, dev)
    out = []
    for step in range(STEPS):
        if step == RESUME_AT:
            buf = io.BytesIO()
            torch.save(dp.compression_state_dict(), buf)
            buf.seek(0)
            state = torch.load(buf, map_location="cpu", weights_only=True)
            dp = _wrap(model, spec, dev)
            dp.load_compression_state_dict(state)
        model.zero_grad(set_to_none=True)
        dp(_inputs(step).to(dev)).backward()
        grads = [p.grad for p in model.parameters()]
        out.append(torch.cat([g.reshape(-1) for g in grads if g is not None]).cpu())
    return out


def _rank(rank: int, world: int, device: str) -> dict[str, Any]:
    del world
    dev = rank_device(device, rank)
    out: dict[str, Any] = {}
    for name in COMPRESSORS.names():
        spec = spec_for(name)
        if spec is None:
            out[name] = {"skipped": "needs an argument; no default spec in this check"}
            continue
        try:
            out[name] = {"spec": spec, "grads": _grads_of(spec, dev)}
        except Exception as exc:  # one compressor's failure must not hide the others
            out[name] = {"spec": spec, "error": f"{type(exc).__name__}: {exc}"}
    return out


def _relative_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        scale = max(float(w.abs().max()), 1e-30)
        worst = max(worst, float((g.double() - w.double()).abs().max()) / scale)
    return worst


def _compare(name: str, dev_run: dict[str, Any], cpu_run: dict[str, Any]) -> Record:
    if "skipped" in dev_run:
        return {"compressor": name, "ok": True, **dev_run}
    rec: Record = {"compressor": name, "spec": dev_run["spec"]}
    errors = {k: r["error"] for k, r in (("device", dev_run), ("cpu", cpu_run)) if "error" in r}
    if errors:
        return {**rec, "ok": False, "error": errors}
    tol = TOLERANCE.get(name, 0.0)
    err = _relative_error(dev_run["grads"], cpu_run["grads"])
    nonzero = all(bool(g.abs().sum() > 0) for g in dev_run["grads"])
    # not vacuous: "none" returns its input exactly, every other built-in changes it
    lost = _relative_error(dev_run["grads"], [_inputs(s) for s in range(STEPS)])
    compressed = name not in SPECS or (lost == 0.0) == (name == "none")
    return {
        **rec,
        "ok": err <= tol and nonzero and compressed,
        "relative_error": err,
        "tolerance": tol,
        "error_vs_uncompressed": lost,
    }


def check_compressors(device: str) -> Record:
    """Each compressor's averaged gradients on ``device`` against the CPU's, step by step."""
    backend = backend_for(device)
    on_device = ranks(_rank, 1, device, backend=backend, timeout_s=25)[0]
    on_cpu = ranks(_rank, 1, "cpu", backend="gloo", timeout_s=25)[0]
    results = [_compare(name, on_device[name], on_cpu[name]) for name in on_device]
    record: Record = {
        "ok": all(r["ok"] for r in results),
        "backend": backend,
        "world_size": 1,
        "steps": STEPS,
        "state_through_cpu_checkpoint_at_step": RESUME_AT,
        "tolerance_is": "max |device - cpu| / max |cpu| over every step's averaged gradient",
        "compressors": results,
    }
    if device == "cpu":
        record["note"] = "--device cpu: the CPU compared with the CPU (trivially equal)"
    return record
