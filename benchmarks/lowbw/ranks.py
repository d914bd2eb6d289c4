"""lowbw's rank functions ``fn(rank, world, ...)``: the timed loops each rank runs.

[Note: fair timing] All configurations of a run share one pair of ranks and take turns in an
order that changes every turn (:mod:`syncline.testing.bench`), so that they all meet the same
background load of this shared machine. A timed unit starts after a barrier, so both ranks
start it together, and ends when rank 0's part (including its collectives) is done.
"""

from __future__ import annotations

import itertools
import statistics
import time
from typing import Any

import torch

from benchmarks.lowbw.engines import exposed_comm_s, setup, train_step
from syncline import comm
from syncline.comm import FlatAllreduce
from syncline.testing.bench import abba, rotated

PROBE_TIMEOUT_S = 300.0


def train(rank: int, world: int, s: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """Train every configuration in ``names`` for ``s['steps']`` steps, one step of each in
    turn (the order rotating every step); each step is timed alone."""
    runs = {name: setup(rank, world, s, name) for name in names}
    seconds: dict[str, list[float]] = {name: [] for name in names}
    losses: dict[str, list[float]] = {name: [] for name in names}
    wire: dict[str, list[int]] = {name: [] for name in names}
    exposed: dict[str, list[float | None]] = {name: [] for name in names}
    for step in range(s["steps"]):
        for name in rotated(names, step):
            comm.barrier(what=f"{name} step {step}")
            t0 = time.perf_counter()
            loss, nbytes = train_step(runs[name])
            seconds[name].append(time.perf_counter() - t0)
            losses[name].append(loss)
            wire[name].append(nbytes)
            exposed[name].append(exposed_comm_s(runs[name]))
    comm.barrier(what="end of training")
    return {
        name: {
            "config": name,
            "n_params": run.n_params,
            "optimizer_momentum": run.opt_momentum,
            "info": run.info,
            "times": list(itertools.accumulate(seconds[name])),
            "losses": losses[name],
            "wire_bytes": wire[name],
            "exposed_comm_s": exposed[name],
        }
        for name, run in runs.items()
    }


def probe_link(rank: int, world: int, numel: int, reps: int) -> dict[str, Any]:
    """Time raw gloo allreduces of ``numel`` fp32 on the emulated link (a sanity check)."""
    ar = FlatAllreduce(timeout_s=PROBE_TIMEOUT_S)
    buf = torch.ones(numel)
    ar.allreduce(buf, "probe warm-up").wait()
    secs = []
    for i in range(reps):
        comm.barrier(what="probe")
        t0 = time.perf_counter()
        ar.allreduce(buf, f"probe {i}").wait()
        secs.append(time.perf_counter() - t0)
    t = statistics.median(secs)
    nbytes = 4 * numel
    return {
        "bytes": nbytes,
        "seconds_median": t,
        # each rank sends 2(p-1)/p * n bytes in a ring allreduce (reduce-scatter, allgather)
        "per_rank_send_mbit_per_s": nbytes * 8 * 2 * (world - 1) / world / t / 1e6,
    }


def loopback(
    rank: int, world: int, s: dict[str, Any], names: list[str], rounds: int, seg: int
) -> dict[str, Any]:
    """Every configuration past its dense warm-up, then timed in segments of ``seg`` steps,
    the order rotating every round and reversed on odd ones."""
    runs = {}
    for name in names:
        run = setup(rank, world, s, name)
        for _ in range(s["warmup_steps"] + 2):  # past every dense warm-up: time the real path
            train_step(run)
        runs[name] = run
    seconds: dict[str, list[float]] = {name: [] for name in names}
    wire: dict[str, int] = {}
    for r in range(rounds):
        for name in abba(rotated(names, r), r):
            comm.barrier(what=f"loopback {name} segment")
            t0 = time.perf_counter()
            for _ in range(seg):
                _, wire[name] = train_step(runs[name])
            comm.barrier(what=f"loopback {name} segment end")
            seconds[name].append(time.perf_counter() - t0)
    return {"seconds": seconds, "wire": wire}
