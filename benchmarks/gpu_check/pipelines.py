"""Checks 4 and 6: single-stage pipelines on the device against plain training there, and the
peak memory of 2BW against 1F1B.

A one-stage pipeline on one rank runs the whole schedule machinery (micro-batches, stashes,
recomputation, weight versions, the loss hand-back) with no message. Its reference is plain
training on the device of the same micro-batches (gradients accumulated, loss / m): GPipe and
1F1B flush every batch, so they must match it; 2BW keeps its rule at any depth (PipeDream-2BW,
``W(t+1) = W(t) - lr * grad f(W(t-1))``), so its reference takes each gradient one step behind,
as the suite's does (``tests/zoo/models.py``). The tolerance is the suite's, 1e-5: a pipeline
sums its micro-batches' gradients in its own order.

Two-rank pipelines need two GPUs: NCCL puts one rank on a GPU, and gloo, which could share
one, carries CUDA tensors in collectives but not in send/recv.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import asdict
from typing import Any

import torch
from torch import nn

from benchmarks.gpu_check.common import (
    COMM_TIMEOUT_S,
    Record,
    backend_for,
    cpu_state,
    gpt,
    lm_batches,
    max_abs_diff,
    moved,
    rank_device,
    ranks,
)
from syncline.comm.device import peak_memory_bytes, reset_peak_memory
from syncline.models import lm_loss
from syncline.pipeline import Pipeline

SCHEDULES = (("gpipe", False), ("1f1b", False), ("2bw", True))  # (schedule, recompute)
MICROBATCHES, STEPS = 4, 4
TOLERANCE = 1e-5
LR, MOMENTUM = 0.1, 0.9
TWO_RANKS = (
    "2-rank pipelines need 2 GPUs: NCCL takes one rank per GPU, and gloo (which lets ranks "
    "share a GPU) has no CUDA send/recv; the CPU test suite runs them with gloo"
)
# check 6: a model whose weights matter next to its activations (2BW holds two versions)
MEMORY_SHAPE = {"cuda": {"n_layer": 4, "n_embd": 256, "n_head": 4, "block_size": 64}}
MEMORY_BATCH = {"cuda": (32, 64), "cpu": (8, 8)}  # (batch, sequence length)


def _sgd(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def _plain(
    model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], stale: bool
) -> list[float]:
    """Train ``model`` on its device: micro-batch gradients summed (loss / m); ``stale``:
    2BW's rule, each gradient taken on the weights one step behind."""
    dev = next(model.parameters()).device
    opt, behind, losses = _sgd(model.parameters()), copy.deepcopy(model), []
    for x, y in batches:
        where = behind if stale else model
        where.zero_grad()
        total = torch.zeros((), device=dev)
        for xs, ys in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES), strict=True):
            loss = lm_loss(where(xs.to(dev)), ys.to(dev)) / MICROBATCHES
            loss.backward()
            total += loss.detach()
        losses.append(float(total))
        newest = copy.deepcopy(model.state_dict())
        for p, q in zip(model.parameters(), where.parameters(), strict=True):
            p.grad = None if q.grad is None else q.grad.clone()
        opt.step()
        behind.load_state_dict(newest)
    return losses


def _pipeline(
    schedule: str, recompute: bool, dev: torch.device, model: nn.Module, **kw: Any
) -> Pipeline:
    return Pipeline(
        model,
        num_stages=1,
        num_microbatches=MICROBATCHES,
        schedule=schedule,
        loss_fn=lm_loss,
        optimizer=_sgd,
        recompute=recompute,
        device=dev,
        timeout_s=COMM_TIMEOUT_S,
        **kw,
    )


def _run(pipe: Pipeline, schedule: str, batches: list[Any], steps: int) -> list[float]:
    """``steps`` batches through ``pipe``; 2BW's last one is finished by ``flush``."""
    it, losses = iter(batches), []
    for _ in range(steps - 1):
        losses.append(float(pipe.train_step(it)))
    last = pipe.flush() if schedule == "2bw" else pipe.train_step(it)
    losses.append(float("nan") if last is None else float(last))
    pipe.flush()
    return losses


def _parity_rank(rank: int, world: int, device: str) -> dict[str, Any]:
    del world
    dev = rank_device(device, rank)
    batches = lm_batches(STEPS)
    out: dict[str, Any] = {"start": cpu_state(gpt())}
    for schedule, recompute in SCHEDULES:
        name = _name(schedule, recompute)
        try:
            pipe = _pipeline(schedule, recompute, dev, gpt())
            losses = _run(pipe, schedule, batches, STEPS)
            reference = gpt().to(dev)
            out[name] = {
                "state": {k: v.cpu() for k, v in pipe.local_state_dict().items()},
                "losses": losses,
                "want_losses": _plain(reference, batches, stale=schedule == "2bw"),
                "want": cpu_state(reference),
            }
        except Exception as exc:  # keep the other schedules' results
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def _name(schedule: str, recompute: bool) -> str:
    return f"{schedule}-recompute" if recompute else schedule


def _compare(name: str, r: dict[str, Any], start: dict[str, torch.Tensor]) -> Record:
    if "error" in r:
        return {"schedule": name, "ok": False, "error": r["error"]}
    diff = max_abs_diff(r["state"], r["want"])
    pairs = zip(r["losses"], r["want_losses"], strict=True)
    loss_diff = max(abs(a - b) for a, b in pairs)  # nan (no loss returned) fails below
    return {
        "schedule": name,
        "reference": "one step behind (the 2BW rule)" if name.startswith("2bw") else "flush",
        "ok": diff <= TOLERANCE and loss_diff <= TOLERANCE and moved(r["state"], start),
        "max_abs_diff": diff,
        "max_loss_diff": loss_diff,
    }


def check_pipelines(device: str) -> Record:
    """One-stage GPipe, 1F1B and 2BW with recomputation against plain training."""
    res = ranks(_parity_rank, 1, device, backend=backend_for(device), timeout_s=45)[0]
    runs = [_compare(_name(s, r), res[_name(s, r)], res["start"]) for s, r in SCHEDULES]
    return {
        "ok": all(r["ok"] for r in runs),
        "num_stages": 1,
        "microbatches": MICROBATCHES,
        "steps": STEPS,
        "tolerance": TOLERANCE,
        "runs": runs,
        "note": TWO_RANKS,
    }


# -- check 6: peak memory -----------------------------------------------------------------------


def _memory_rank(rank: int, world: int, device: str, schedule: str) -> dict[str, Any]:
    del world
    dev = rank_device(device, rank)
    batch, seq = MEMORY_BATCH[device]
    shape = MEMORY_SHAPE.get(device, {})
    batches = lm_batches(STEPS, batch=batch, seq=seq)
    pipe = _pipeline(schedule, False, dev, gpt(**shape), track_memory=True)
    reset_peak_memory(dev)
    _run(pipe, schedule, batches, STEPS)
    peak = peak_memory_bytes(dev)
    return {"peak": asdict(peak), "stages": {s: asdict(v) for s, v in pipe.memory_stats().items()}}


def check_pipeline_memory(device: str) -> Record:
    """Peak memory of a one-stage 2BW pipeline against 1F1B, each in a fresh process."""
    backend = backend_for(device)
    got = {
        s: ranks(_memory_rank, 1, device, s, backend=backend, timeout_s=25)[0]
        for s in ("1f1b", "2bw")
    }
    one, two = got["1f1b"]["peak"], got["2bw"]["peak"]
    record: Record = {
        "kind": one["kind"],
        "peak_bytes": {"1f1b": one["bytes"], "2bw": two["bytes"]},
        "ratio_2bw_to_1f1b": two["bytes"] / one["bytes"] if one["bytes"] else None,
        "memory_stats": {s: got[s]["stages"] for s in got},
        "expected": "2bw >= 1f1b: 2BW holds two weight versions",
    }
    if device == "cuda":
        record["reserved_bytes"] = {"1f1b": one["reserved_bytes"], "2bw": two["reserved_bytes"]}
        record["ok"] = two["bytes"] >= one["bytes"]
    else:
        record["ok"] = True  # a figure only: RSS is the process's and cannot be reset
        record["note"] = (
            "CPU: the process's peak RSS (interpreter and torch included); RSS peaks cannot "
            "be reset, so each schedule runs in a fresh process and the difference is noise "
            "next to the process's size"
        )
    return record
