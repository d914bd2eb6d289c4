"""The rank function of the time-to-accuracy benchmark: train one engine until its held-out
loss reaches the target, timing the training alone.

Every engine starts from the same initialisation and sees the same batches as in
:mod:`benchmarks.lowbw.engines` (whose engines it reuses). The held-out loss is measured on
bytes that follow the training corpus (never trained on), every ``eval_every`` steps, on each
rank's own weights (equal for every data-parallel engine); its time is not counted. Both
ranks learn the verdict from rank 0 by one broadcast per evaluation, so they stop together.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from benchmarks.lowbw.engines import setup, train_step
from syncline import comm
from syncline.data import ByteDataset, stdlib_corpus
from syncline.models import lm_loss


def heldout_batches(s: dict[str, Any]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``eval_batches`` batches of ``eval_batch`` sequences from the bytes after the corpus."""
    corpus = s["corpus_bytes"]
    data = stdlib_corpus(corpus + s["eval_bytes"])[corpus:]
    ds = ByteDataset(data, s["block_size"])
    stride = max(1, (len(ds) - 1) // (s["eval_batches"] * s["eval_batch"]))
    idx = torch.arange(s["eval_batches"] * s["eval_batch"]) * stride
    return [ds.get(chunk) for chunk in idx.split(s["eval_batch"])]


def _module(engine: Any) -> torch.nn.Module:
    module: torch.nn.Module = getattr(engine, "module", engine)
    return module


@torch.no_grad()
def heldout_loss(engine: Any, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    module = _module(engine)
    was = module.training
    module.eval()
    total = sum(float(lm_loss(module(x), y)) for x, y in batches)
    module.train(was)
    return total / len(batches)


def _crossing(
    before: dict[str, float], at: dict[str, float], target: float | None
) -> dict[str, float]:
    """Where the held-out curve crosses ``target`` between two evaluations, linearly
    interpolated in steps and wall time: an engine whose loss equals DDP's up to rounding
    would otherwise be charged up to ``eval_every`` steps for missing it by an epsilon."""
    assert target is not None
    drop = before["heldout_loss"] - at["heldout_loss"]
    f = 1.0 if drop <= 0 else min(1.0, max(0.0, (before["heldout_loss"] - target) / drop))
    return {
        **at,
        "eval_step": at["step"],
        "step": before["step"] + f * (at["step"] - before["step"]),
        "wall_s": before["wall_s"] + f * (at["wall_s"] - before["wall_s"]),
    }


def train_to_target(
    rank: int, world: int, s: dict[str, Any], name: str, target: float | None, max_steps: int
) -> dict[str, Any]:
    """Train ``name`` until its held-out loss is at most ``target`` (``None``: for exactly
    ``max_steps`` steps, evaluating at the end too) or ``max_steps`` pass."""
    torch.set_num_threads(s["threads_per_rank"])
    run = setup(rank, world, s, name)
    heldout = heldout_batches(s)
    curve: list[dict[str, float]] = []
    train_losses: list[float] = []
    wall = 0.0
    reached: dict[str, float] | None = None
    loss0 = heldout_loss(run.engine, heldout)
    curve.append({"step": 0, "wall_s": 0.0, "heldout_loss": loss0})
    for step in range(max_steps):
        comm.barrier(what=f"{name} step {step}")
        t0 = time.perf_counter()
        loss, _ = train_step(run)
        wall += time.perf_counter() - t0
        train_losses.append(loss)
        done = step + 1
        if done % s["eval_every"] and done != max_steps:
            continue
        value = heldout_loss(run.engine, heldout)
        point = {"step": done, "wall_s": wall, "heldout_loss": value}
        curve.append(point)
        verdict = torch.tensor(
            [1.0 if target is not None and value <= target else 0.0, float(math.isfinite(value))]
        )
        comm.broadcast_tensors([verdict], src=0, what=f"{name} verdict at step {done}")
        if verdict[0] > 0:
            reached = _crossing(curve[-2], point, target)
            break
        if verdict[1] == 0:  # diverged: it will not get there
            break
    return {
        "config": name,
        "target": target,
        "reached": reached,
        "steps_run": run.step,
        "wall_s": wall,
        "curve": curve,
        "train_losses": train_losses,
        "info": run.info,
    }
