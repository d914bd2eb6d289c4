"""Check 2: syncline's DataParallel against torch's DDP on the device, bit for bit, in fp32,
fp16 and bf16, with bucket tuning and bucket rebuilding on.

Both engines average the same gradients: DDP divides by the world size before its allreduce,
DataParallel multiplies by the reciprocal (bit-identical for a power of two) and sums in
place; a sum of two addends is the same in either order. So the weights after every step must
be equal, not close. fp16 scales the loss with syncline's ``LossScaler`` under both engines
(a power-of-two scale: unscaling is exact), so the engines alone differ.

Where: one rank per GPU with NCCL (one GPU: world size 1), and two ranks sharing the GPU
through gloo, which carries CUDA tensors in collectives; on ``--device cpu`` both settings
run with gloo on the CPU.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from benchmarks.gpu_check.common import (
    COMM_TIMEOUT_S,
    Record,
    backend_for,
    bit_equal,
    cpu_state,
    device_ids,
    max_abs_diff,
    mlp,
    mlp_batch,
    moved,
    rank_device,
    ranks,
)
from syncline import DataParallel
from syncline.dp.precision import LossScaler, autocast

PRECISIONS = ("fp32", "fp16", "bf16")
EXTRA_STEPS = 2  # after tuning has chosen: steps on the chosen plan
MAX_STEPS = 30  # tuning must have chosen by then
LR, MOMENTUM = 0.05, 0.9


def _wrap(kind: str, model: nn.Module, dev: torch.device) -> nn.Module:
    ids = device_ids(dev)
    if kind == "ddp":
        return DDP(model, device_ids=ids)
    return DataParallel(
        model,
        device_ids=ids,
        rebuild_buckets=True,
        autotune_buckets=True,  # one step per candidate, every candidate to the final
        tune_steps_per_trial=1,
        tune_rounds=1,
        tune_final_rounds=1,
        tune_keep_margin=1e6,
        tune_min_bucket_mb=0.002,  # several cuts of this small model's 27 KiB
        timeout_s=COMM_TIMEOUT_S,
    )


def _train(
    kind: str, precision: str, dev: torch.device, rank: int, world: int, steps: int | None
) -> dict[str, Any]:
    """Train a fresh copy with engine ``kind``; ``steps=None``: until tuning has chosen, then
    ``EXTRA_STEPS`` more (DataParallel only)."""
    model = mlp().to(dev)
    wrapped = _wrap(kind, model, dev)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    scaler = LossScaler(timeout_s=COMM_TIMEOUT_S) if precision == "fp16" else None
    step, extra = 0, 0
    while (step < steps) if steps is not None else (extra < EXTRA_STEPS and step < MAX_STEPS):
        x, y = (t.to(dev) for t in mlp_batch(step, rank, world))
        opt.zero_grad(set_to_none=True)
        with autocast(precision, dev):
            loss = F.cross_entropy(wrapped(x), y)
        (loss if scaler is None else scaler.scale(loss)).backward()
        if scaler is None or scaler.unscale_or_skip(model.parameters(), step):
            opt.step()
        step += 1
        extra += steps is None and not getattr(wrapped, "tuning_pending", False)
    return {
        "state": cpu_state(model),
        "steps": step,
        "tuning": getattr(wrapped, "bucket_tuning", None),
        "skipped": None if scaler is None else scaler.skipped,
    }


def _rank(rank: int, world: int, device: str) -> dict[str, Any]:
    dev = rank_device(device, rank)
    out: dict[str, Any] = {"start": cpu_state(mlp())}
    with warnings.catch_warnings():  # DDP 2.13's FutureWarnings are not what is checked
        warnings.simplefilter("ignore", FutureWarning)
        for precision in PRECISIONS:
            ours = _train("syncline", precision, dev, rank, world, None)
            theirs = _train("ddp", precision, dev, rank, world, ours["steps"])
            out[precision] = {"syncline": ours, "ddp": theirs}
    return out


def _compare(per_rank: list[dict[str, Any]], precision: str) -> Record:
    ours = [r[precision]["syncline"] for r in per_rank]
    theirs = [r[precision]["ddp"] for r in per_rank]
    tuning = ours[0]["tuning"] or {}
    return {
        "precision": precision,
        "bit_exact": all(
            bit_equal(o["state"], t["state"]) for o, t in zip(ours, theirs, strict=True)
        ),
        "max_abs_diff": max(
            max_abs_diff(o["state"], t["state"]) for o, t in zip(ours, theirs, strict=True)
        ),
        "ranks_agree": all(bit_equal(o["state"], ours[0]["state"]) for o in ours),
        "trained": moved(ours[0]["state"], per_rank[0]["start"]),
        "steps": ours[0]["steps"],
        "tuning_chosen": tuning.get("chosen"),
        "tuning_candidates": len(tuning.get("candidates", [])),
        "fp16_skipped_steps": ours[0]["skipped"],
    }


def settings(device: str) -> list[tuple[str, int, str]]:
    """(backend, world size, what) of each run on ``device``."""
    if device == "cuda":
        return [
            ("nccl", 1, "NCCL, one rank on the GPU"),
            ("gloo", 2, "gloo, two ranks sharing the GPU (CUDA tensors in gloo collectives)"),
        ]
    return [("gloo", 1, "gloo, one rank on the CPU"), ("gloo", 2, "gloo, two ranks on the CPU")]


def check_dp_vs_ddp_exact(device: str) -> Record:
    """DataParallel == DDP bit for bit after training, per precision and setting."""
    runs: list[Record] = []
    for backend, world, what in settings(device):
        try:
            per_rank = ranks(_rank, world, device, backend=backend, timeout_s=50)
        except Exception as exc:  # keep the other settings' results
            runs.append({"setting": what, "error": f"{type(exc).__name__}: {exc}"})
            continue
        for precision in PRECISIONS:
            runs.append({"setting": what, **_compare(per_rank, precision)})
    ok = all(
        "error" not in r and r["bit_exact"] and r["ranks_agree"] and r["trained"] for r in runs
    )
    return {
        "ok": ok,
        "default_backend": backend_for(device),
        "criterion": "weights after training equal bit for bit (torch.equal) on every rank",
        "runs": runs,
    }
