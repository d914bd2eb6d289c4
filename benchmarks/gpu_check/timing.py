"""Check 5: DataParallel against DDP in steps per second on the device, timed with CUDA events.

One rank (NCCL on a GPU, gloo on the CPU) holds a copy of the model under each engine (same
seed). After a warm-up that lasts until syncline's bucket tuning has chosen, the engines take
turns in ABBA order (``syncline.testing.bench``), each turn ``STEPS_PER_ROUND`` steps timed as
one interval by :class:`~syncline.comm.device.Stopwatch` (CUDA events on the current stream:
one host wait per interval, none inside it). The figure is the median steps/s of each engine,
the ratio of the medians and the median of the per-round ratios (neighbouring rounds, so slow
drift cancels). A figure, not a verdict: the check fails only if a round cannot be timed.
"""

from __future__ import annotations

import statistics
import warnings
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from benchmarks.gpu_check.common import (
    COMM_TIMEOUT_S,
    Record,
    backend_for,
    device_ids,
    gpt,
    lm_batches,
    rank_device,
    ranks,
)
from syncline import DataParallel
from syncline.comm.device import Stopwatch, synchronize
from syncline.models import lm_loss
from syncline.testing.bench import abba, paired_ratios

ENGINES = ("syncline", "ddp")
# (model shape, batch, sequence, rounds, steps per round) per device: seconds of work on each
SHAPE = {
    "cuda": ({"n_layer": 4, "n_embd": 256, "n_head": 4, "block_size": 128}, 32, 128, 7, 20),
    "cpu": ({"n_layer": 1, "n_embd": 32, "n_head": 2, "block_size": 16}, 8, 16, 5, 4),
}
MAX_WARMUP = 60


def _engines(dev: torch.device, shape: dict[str, Any]) -> dict[str, tuple[nn.Module, Any]]:
    ids = device_ids(dev)
    out: dict[str, tuple[nn.Module, Any]] = {}
    for kind in ENGINES:
        model = gpt(**shape).to(dev)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            wrapped = (
                DDP(model, device_ids=ids)
                if kind == "ddp"
                else DataParallel(model, device_ids=ids, timeout_s=COMM_TIMEOUT_S)
            )
        out[kind] = (wrapped, torch.optim.AdamW(model.parameters(), lr=1e-3))
    return out


def _steps(engine: tuple[nn.Module, Any], batch: tuple[torch.Tensor, torch.Tensor], n: int) -> None:
    wrapped, opt = engine
    x, y = batch
    for _ in range(n):
        opt.zero_grad(set_to_none=True)
        lm_loss(wrapped(x), y).backward()
        opt.step()


def _rank(rank: int, world: int, device: str) -> dict[str, Any]:
    del world
    dev = rank_device(device, rank)
    shape, batch, seq, rounds, per_round = SHAPE[device]
    x, y = lm_batches(1, batch=batch, seq=seq)[0]
    data = (x.to(dev), y.to(dev))
    engines = _engines(dev, shape)
    warm = 0
    while warm < 3 or (engines["syncline"][0].tuning_pending and warm < MAX_WARMUP):
        for engine in engines.values():
            _steps(engine, data, 1)
        warm += 1
    synchronize(dev)
    watch = Stopwatch(dev)
    rate: dict[str, list[float]] = {k: [] for k in ENGINES}
    for turn in range(rounds):
        for kind in abba(ENGINES, turn):
            watch.start()
            _steps(engines[kind], data, per_round)
            watch.stop()
            rate[kind].append(per_round / watch.elapsed_s())
    return {
        "rate": rate,
        "warmup_steps": warm,
        "tuning": engines["syncline"][0].bucket_tuning,
        "shape": shape,
        "batch": batch,
        "seq_len": seq,
        "rounds": rounds,
        "steps_per_round": per_round,
    }


def check_dp_vs_ddp_speed(device: str) -> Record:
    """Median steps/s of DataParallel and DDP, and their ratio (see the module docstring)."""
    backend = backend_for(device)
    res = ranks(_rank, 1, device, backend=backend, timeout_s=75)[0]
    rate = res.pop("rate")
    timed = all(r > 0 for rates in rate.values() for r in rates)
    tuning = res.pop("tuning") or {}
    return {
        "ok": timed,
        "backend": backend,
        "world_size": 1,
        "clock": "CUDA events" if device == "cuda" else "perf_counter",
        **summarise(rate),
        "steps_per_s": rate,
        "tuning_chosen": tuning.get("chosen"),
        **res,
    }


def summarise(rate: dict[str, list[float]]) -> Record:
    """Medians, their ratio and the median per-round ratio of ``rate[engine]`` (steps/s)."""
    ours, theirs = rate["syncline"], rate["ddp"]
    return {
        "syncline_steps_per_s": statistics.median(ours),
        "ddp_steps_per_s": statistics.median(theirs),
        "ratio_of_medians": statistics.median(ours) / statistics.median(theirs),
        "median_round_ratio": statistics.median(paired_ratios(ours, theirs)),
    }
