"""Check 7: host syncs per steady-state step, counted by CUDA itself.

``torch.cuda.set_sync_debug_mode("warn")`` makes every operation that waits for the GPU
(``.item()``, ``nonzero``, a copy to the host, ...) warn. Over ``STEPS`` steps after a
warm-up (bucket tuning done, caches built), the warnings are counted, from Python's warning
machinery and from the C++ handler's lines on stderr (warnings raised in autograd's own
threads go there), with the source line that raised each.

The budget per step: 0 for DataParallel in fp32 (nothing to read on the host); 1 for
DataParallel in fp16 (the overflow verdict decides on the host whether to step); 0 for a
pipeline, whose ``train_step(..., return_tensor=True)`` keeps the loss on the device. The
check's own loop reads nothing (the loss stays on the device).

Not available on the CPU (there is no device to wait for): the record says so.
"""

from __future__ import annotations

import collections
import itertools
import os
import tempfile
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.gpu_check.common import (
    COMM_TIMEOUT_S,
    Record,
    device_ids,
    gpt,
    lm_batches,
    mlp,
    mlp_batch,
    rank_device,
    ranks,
)
from benchmarks.gpu_check.pipelines import _pipeline
from syncline import DataParallel
from syncline.dp.precision import LossScaler, autocast

WARMUP, MAX_WARMUP, STEPS = 6, 60, 5
MARK = "synchroniz"  # "called a synchronizing CUDA operation"


@contextmanager
def _stderr_to(path: str) -> Iterator[None]:
    """The process's file descriptor 2 into ``path`` (C++ warnings bypass ``sys.stderr``)."""
    saved = os.dup(2)
    with open(path, "w") as f:
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def count_syncs(run: Callable[[], None], dev: torch.device) -> dict[str, Any]:
    """Warnings of ``sync_debug_mode`` while ``run()`` runs: the count and where each came
    from (``file:line: message`` -> times)."""
    sites: collections.Counter[str] = collections.Counter()
    torch.cuda.synchronize(dev)
    with tempfile.NamedTemporaryFile("r", suffix=".stderr") as err:
        with warnings.catch_warnings(record=True) as caught, _stderr_to(err.name):
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                run()
                torch.cuda.synchronize(dev)  # not a counted sync: the debug mode skips it
            finally:
                torch.cuda.set_sync_debug_mode(0)
        for w in caught:
            if MARK in str(w.message):
                first = str(w.message).splitlines()[0][:160]
                sites[f"{os.path.basename(w.filename)}:{w.lineno}: {first}"] += 1
        with open(err.name) as f:
            printed = f.read().splitlines()
        for line in printed:
            if MARK in line:
                sites[f"(C++ stderr) {line.strip()[:160]}"] += 1
    return {"syncs": sum(sites.values()), "sites": dict(sites)}


@dataclass(frozen=True)
class Case:
    """One training setup: ``step(i)`` runs step ``i`` (and returns what the API returns);
    ``settling()`` is true while it still changes itself (DataParallel's bucket tuning)."""

    step: Callable[[int], Any]
    settling: Callable[[], bool] = lambda: False


def _dp_case(dev: torch.device, precision: str) -> Case:
    model = mlp().to(dev)
    dp = DataParallel(model, device_ids=device_ids(dev), timeout_s=COMM_TIMEOUT_S)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = LossScaler(timeout_s=COMM_TIMEOUT_S) if precision == "fp16" else None
    batches = [tuple(t.to(dev) for t in mlp_batch(s, 0, 1)) for s in range(4)]

    def step(i: int) -> Any:
        x, y = batches[i % len(batches)]
        opt.zero_grad(set_to_none=True)
        with autocast(precision, dev):
            loss = F.cross_entropy(dp(x), y)
        (loss if scaler is None else scaler.scale(loss)).backward()
        if scaler is None or scaler.unscale_or_skip(model.parameters(), i):
            opt.step()
        return loss.detach()

    return Case(step, lambda: dp.tuning_pending)


def _pipeline_case(dev: torch.device, schedule: str) -> Case:
    pipe = _pipeline(schedule, False, dev, gpt())
    batches = itertools.cycle([(x.to(dev), y.to(dev)) for x, y in lm_batches(4)])

    def step(i: int) -> Any:
        del i
        return pipe.train_step(batches, return_tensor=True)

    return Case(step)


#: name -> (builder, host syncs allowed per step; None: 1 if the step returns a Python float
#: (the pipeline's loss, read on the host), else 0)
CASES: dict[str, tuple[Callable[[torch.device], Case], int | None]] = {
    "dataparallel-fp32": (lambda dev: _dp_case(dev, "fp32"), 0),
    "dataparallel-fp16": (lambda dev: _dp_case(dev, "fp16"), 1),
    "pipeline-1f1b": (lambda dev: _pipeline_case(dev, "1f1b"), 0),
    "pipeline-2bw": (lambda dev: _pipeline_case(dev, "2bw"), 0),
}


def _case(build: Callable[[torch.device], Case], budget: int | None, dev: torch.device) -> Record:
    case = build(dev)
    returned, warm = None, 0
    while warm < WARMUP or (case.settling() and warm < MAX_WARMUP):
        returned = case.step(warm)
        warm += 1

    def steady() -> None:
        for i in range(warm, warm + STEPS):
            case.step(i)

    got = count_syncs(steady, dev)
    if budget is None:
        budget = 1 if isinstance(returned, float) else 0
    per_step = got["syncs"] / STEPS
    return {
        "ok": per_step <= budget,
        "syncs_per_step": per_step,
        "budget": budget,
        "step_returns": type(returned).__name__,
        "warmup_steps": warm,
        **got,
    }


def _rank(rank: int, world: int) -> dict[str, Any]:
    del world
    dev = rank_device("cuda", rank)
    out: dict[str, Any] = {}
    for name, (build, budget) in CASES.items():
        try:
            out[name] = _case(build, budget, dev)
        except Exception as exc:  # keep the other cases
            out[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    return out


def check_host_syncs(device: str) -> Record:
    """Host syncs per steady-state step of DataParallel and of one-stage pipelines."""
    if device != "cuda":
        return {
            "ok": True,
            "skipped": "not available on cpu: torch.cuda.set_sync_debug_mode needs CUDA",
        }
    cases = ranks(_rank, 1, backend="nccl", timeout_s=45)[0]
    return {
        "ok": all(c["ok"] for c in cases.values()),
        "steps_counted": STEPS,
        "cases": cases,
    }
