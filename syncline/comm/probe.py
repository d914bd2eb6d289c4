"""Measure the links between ranks: point-to-point and allreduce times by message size.

What the planner's cluster description is fitted from (``syncline plan --profile``). Each
size is timed ``repeats`` times after a warm-up, every rank taking part; the median is kept.
Every wait is bounded and names the probe, as all of this layer's waits are. The buffers live
where the run's backend communicates (a GPU under NCCL), and each timed wait drains the device
before the host clock is read: under NCCL a wait alone only orders streams.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from syncline.comm.collectives import Pending, host_list
from syncline.comm.device import comm_device, synchronize
from syncline.comm.groups import Group, backend_name, barrier, global_rank

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


def _device(group: Group, device: torch.device | None) -> torch.device:
    """Where the probe's buffers live: the communication device of ``group``'s backend for a
    rank computing on ``device`` (default: the CPU's; under NCCL the current CUDA device)."""
    return comm_device(backend_name(group), device or torch.device("cpu"))


def _wait(work: dist.Work | None, what: str, timeout_s: float, device: torch.device) -> None:
    """Wait until the work is done *on the host*: under NCCL :meth:`Pending.wait` is a stream
    wait, and a probe times the network with the host clock, so the stream is drained too."""
    Pending([] if work is None else [work], what, timeout_s, global_rank()).wait()
    synchronize(device)


def _barrier(group: Group, timeout_s: float, device: torch.device) -> None:
    barrier(group, timeout_s=timeout_s, what="probe barrier", device=device)


def time_ping_pong(
    sizes: Sequence[int],
    *,
    peer: int,
    repeats: int = 5,
    timeout_s: float = 60.0,
    device: torch.device | None = None,
) -> list[float]:
    """One-way seconds of a message of each size (bytes) between this rank and ``peer``
    (a round trip halved); both ranks call it with each other as ``peer``. The lower rank
    sends first. The buffers live where the default group's backend communicates for a rank
    computing on ``device`` (a GPU's memory under NCCL), so the link measured is the run's."""
    me = global_rank()
    dev = _device(None, device)
    out = []
    for size in sizes:
        buf = torch.zeros(max(1, size), dtype=torch.uint8, device=dev)
        times = []
        for rep in range(repeats + 1):
            what = f"ping-pong of {size} B with rank {peer}"
            t0 = time.perf_counter()
            if me < peer:
                _wait(dist.isend(buf, peer, tag=rep), what, timeout_s, dev)
                _wait(dist.irecv(buf, peer, tag=rep), what, timeout_s, dev)
            else:
                _wait(dist.irecv(buf, peer, tag=rep), what, timeout_s, dev)
                _wait(dist.isend(buf, peer, tag=rep), what, timeout_s, dev)
            if rep:
                times.append((time.perf_counter() - t0) / 2)
        out.append(statistics.median(times))
    return out


def time_allreduce(
    sizes: Sequence[int],
    *,
    group: Group = None,
    repeats: int = 5,
    timeout_s: float = 60.0,
    device: torch.device | None = None,
) -> list[float]:
    """Seconds of an fp32 sum allreduce of each size (bytes) over ``group`` (every member
    calls it); the slowest rank's median, so all ranks return the same numbers. Buffers on
    the communication device for ``device``, as in :func:`time_ping_pong`."""
    dev = _device(group, device)
    out = []
    for size in sizes:
        buf = torch.zeros(max(1, size // 4), dtype=torch.float32, device=dev)
        times = []
        for rep in range(repeats + 1):
            _barrier(group, timeout_s, dev)
            t0 = time.perf_counter()
            what = f"allreduce probe of {size} B"
            _wait(dist.all_reduce(buf, group=group, async_op=True), what, timeout_s, dev)
            if rep:
                times.append(time.perf_counter() - t0)
        out.append(statistics.median(times))
    slowest = torch.tensor(out, dtype=torch.float64, device=dev)
    _wait(
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group, async_op=True),
        "allreduce probe result",
        timeout_s,
        dev,
    )
    return [float(v) for v in host_list(slowest, meta=out)]


def overlap_slowdown(
    compute: Callable[[], None],
    nbytes: int,
    *,
    group: Group = None,
    repeats: int = 3,
    timeout_s: float = 60.0,
    device: torch.device | None = None,
) -> tuple[float, float, float]:
    """How much ``compute`` slows down while an allreduce of ``nbytes`` runs beside it.

    Returns ``(compute alone, compute with the allreduce, allreduce alone)`` in seconds,
    medians; every member of ``group`` calls it at the same time. ``device``: where
    ``compute`` runs (its queued work is drained before each reading of the clock) and,
    through the group's backend, where the allreduce's buffer lives.
    """
    dev = _device(group, device)
    own = device or dev
    buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=dev)
    alone, shared, comm = [], [], []
    for rep in range(repeats + 1):
        _barrier(group, timeout_s, dev)
        t0 = time.perf_counter()
        compute()
        synchronize(own)
        t1 = time.perf_counter()
        _barrier(group, timeout_s, dev)
        t2 = time.perf_counter()
        _wait(dist.all_reduce(buf, group=group, async_op=True), "overlap probe", timeout_s, dev)
        t3 = time.perf_counter()
        _barrier(group, timeout_s, dev)
        work = dist.all_reduce(buf, group=group, async_op=True)
        t4 = time.perf_counter()
        compute()
        synchronize(own)
        t5 = time.perf_counter()
        _wait(work, "overlap probe", timeout_s, dev)
        if rep:
            alone.append(t1 - t0)
            comm.append(t3 - t2)
            shared.append(t5 - t4)
    return statistics.median(alone), statistics.median(shared), statistics.median(comm)
