"""Measure the links between ranks: point-to-point and allreduce times by message size.

What the planner's cluster description is fitted from (``syncline plan --profile``). Each
size is timed ``repeats`` times after a warm-up, every rank taking part; the median is kept.
Every wait is bounded and names the probe, as all of this layer's waits are.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from syncline.comm.collectives import Pending
from syncline.comm.groups import Group, global_rank

__all__ = ["overlap_slowdown", "own_group", "time_allreduce", "time_ping_pong"]


def own_group(timeout_s: float = 60.0) -> Group:
    """A group of this rank alone (collective: every rank creates every one-rank group), for
    timing work whose collectives must cost nothing."""
    import datetime

    mine: Group = None
    for r in range(dist.get_world_size()):
        group = dist.new_group([r], timeout=datetime.timedelta(seconds=timeout_s))
        if r == dist.get_rank():
            mine = group
    return mine


def _wait(work: dist.Work | None, what: str, timeout_s: float) -> None:
    Pending([] if work is None else [work], what, timeout_s, global_rank()).wait()


def time_ping_pong(
    sizes: Sequence[int], *, peer: int, repeats: int = 5, timeout_s: float = 60.0
) -> list[float]:
    """One-way seconds of a message of each size (bytes) between this rank and ``peer``
    (a round trip halved); both ranks call it with each other as ``peer``. The lower rank
    sends first."""
    me = global_rank()
    out = []
    for size in sizes:
        buf = torch.zeros(max(1, size), dtype=torch.uint8)
        times = []
        for rep in range(repeats + 1):
            what = f"ping-pong of {size} B with rank {peer}"
            t0 = time.perf_counter()
            if me < peer:
                _wait(dist.isend(buf, peer, tag=rep), what, timeout_s)
                _wait(dist.irecv(buf, peer, tag=rep), what, timeout_s)
            else:
                _wait(dist.irecv(buf, peer, tag=rep), what, timeout_s)
                _wait(dist.isend(buf, peer, tag=rep), what, timeout_s)
            if rep:
                times.append((time.perf_counter() - t0) / 2)
        out.append(statistics.median(times))
    return out


def time_allreduce(
    sizes: Sequence[int], *, group: Group = None, repeats: int = 5, timeout_s: float = 60.0
) -> list[float]:
    """Seconds of an fp32 sum allreduce of each size (bytes) over ``group`` (every member
    calls it); the slowest rank's median, so all ranks return the same numbers."""
    out = []
    for size in sizes:
        buf = torch.zeros(max(1, size // 4), dtype=torch.float32)
        times = []
        for rep in range(repeats + 1):
            _wait(dist.barrier(group=group, async_op=True), "probe barrier", timeout_s)
            t0 = time.perf_counter()
            what = f"allreduce probe of {size} B"
            _wait(dist.all_reduce(buf, group=group, async_op=True), what, timeout_s)
            if rep:
                times.append(time.perf_counter() - t0)
        out.append(statistics.median(times))
    slowest = torch.tensor(out, dtype=torch.float64)
    _wait(
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group, async_op=True),
        "allreduce probe result",
        timeout_s,
    )
    return [float(v) for v in slowest.tolist()]


def overlap_slowdown(
    compute: Callable[[], None],
    nbytes: int,
    *,
    group: Group = None,
    repeats: int = 3,
    timeout_s: float = 60.0,
) -> tuple[float, float, float]:
    """How much ``compute`` slows down while an allreduce of ``nbytes`` runs beside it.

    Returns ``(compute alone, compute with the allreduce, allreduce alone)`` in seconds,
    medians; every member of ``group`` calls it at the same time.
    """
    buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
    alone, shared, comm = [], [], []
    for rep in range(repeats + 1):
        _wait(dist.barrier(group=group, async_op=True), "probe barrier", timeout_s)
        t0 = time.perf_counter()
        compute()
        t1 = time.perf_counter()
        _wait(dist.barrier(group=group, async_op=True), "probe barrier", timeout_s)
        t2 = time.perf_counter()
        _wait(dist.all_reduce(buf, group=group, async_op=True), "overlap probe", timeout_s)
        t3 = time.perf_counter()
        _wait(dist.barrier(group=group, async_op=True), "probe barrier", timeout_s)
        work = dist.all_reduce(buf, group=group, async_op=True)
        t4 = time.perf_counter()
        compute()
        t5 = time.perf_counter()
        _wait(work, "overlap probe", timeout_s)
        if rep:
            alone.append(t1 - t0)
            comm.append(t3 - t2)
            shared.append(t5 - t4)
    return statistics.median(alone), statistics.median(shared), statistics.median(comm)
