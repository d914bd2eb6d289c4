"""The device a rank computes and communicates on, one clock for it, one memory meter for it.

Why a module of its own: CUDA work is asynchronous, so ``time.perf_counter`` around a kernel
launch measures the launch, not the work; and process RSS says nothing of GPU memory. Every
place that times a step, a backward's exposed communication, a bucket-tuning trial, a traced
action or a profiled layer, and every place that reports peak memory, goes through here, so
the numbers mean the same thing on every device:

- on a CUDA device, :class:`Stopwatch` records CUDA events on the current stream and reads
  them only when asked (:meth:`Stopwatch.elapsed_s` synchronises on the *end* event, once);
  :func:`peak_memory_bytes` is ``torch.cuda.max_memory_allocated``;
- on the CPU (and ``meta``), the stopwatch is ``time.perf_counter`` and the memory meter is
  the process's peak resident set size.

Which device a rank owns follows torchrun's convention: ``LOCAL_RANK % device_count()``,
because a scheduler that gives each process one visible GPU (``CUDA_VISIBLE_DEVICES``) makes
``cuda:LOCAL_RANK`` an invalid ordinal for every rank but the first. Which device a process
group's tensors must live on follows its backend: NCCL takes CUDA tensors only, gloo CPU ones
(and CUDA tensors for collectives, not for send/recv).
"""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass

import torch

from syncline.errors import ConfigError

__all__ = [
    "PeakMemory",
    "Stopwatch",
    "comm_device",
    "local_device",
    "peak_memory_bytes",
    "reset_peak_memory",
    "synchronize",
]


def local_device(kind: str, local_rank: int) -> torch.device:
    """The device of the rank with ``local_rank`` on its node: ``cpu``, or
    ``cuda:(local_rank % visible GPUs)``.

    Raises:
        ConfigError: ``kind`` is not ``"cpu"`` or ``"cuda"``, or ``"cuda"`` with no GPU visible.
    """
    if kind == "cpu":
        return torch.device("cpu")
    if kind != "cuda":
        raise ConfigError(f"device={kind!r} is not supported; valid: cpu, cuda")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ConfigError("device='cuda' but no CUDA device is visible to this process")
    return torch.device("cuda", local_rank % count)


def comm_device(backend: str, compute: torch.device) -> torch.device:
    """Where tensors handed to a group of ``backend`` must live, for a rank computing on
    ``compute``: NCCL needs CUDA tensors (the current device of this rank), gloo takes
    CPU tensors everywhere (and CUDA ones for collectives only), other backends (``fake``
    in tests) take the compute device."""
    if backend == "nccl":
        if compute.type in ("cuda", "meta"):  # meta: the tests' stand-in for a GPU
            return compute
        return torch.device("cuda", torch.cuda.current_device())
    if backend == "gloo":
        return torch.device("cpu") if compute.type not in ("cuda", "meta") else compute
    return compute


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a no-op off CUDA). Not for the step's hot path:
    for the edges of a measurement, a profile, or a checkpoint."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Stopwatch:
    """Times the work queued on ``device`` between :meth:`start` and :meth:`stop`.

    On CUDA it records events on the current stream (no host sync when started or stopped;
    reading :meth:`elapsed_s` waits for the end event only); elsewhere it reads
    ``time.perf_counter``. One stopwatch can be reused: each :meth:`start` begins a new
    interval.

    Example:
        >>> watch = Stopwatch(torch.device("cpu"))
        >>> watch.start(); y = x @ x; watch.stop()
        >>> watch.elapsed_s() >= 0
        True
    """

    device: torch.device

    def __post_init__(self) -> None:
        self._cuda = self.device.type == "cuda"
        self._t0 = self._t1 = 0.0
        self._events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        self._running = False

    def start(self) -> Stopwatch:
        if self._cuda:
            with torch.cuda.device(self.device):
                begin = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                begin.record()
            self._events = (begin, end)
        else:
            self._t0 = time.perf_counter()
        self._running = True
        return self

    def stop(self) -> Stopwatch:
        if not self._running:
            raise RuntimeError("Stopwatch.stop() called before start()")
        if self._cuda:
            assert self._events is not None
            with torch.cuda.device(self.device):
                self._events[1].record()
        else:
            self._t1 = time.perf_counter()
        self._running = False
        return self

    def elapsed_s(self) -> float:
        """Seconds between the last start and stop (on CUDA: waits for the stop event)."""
        if self._running:
            raise RuntimeError("Stopwatch.elapsed_s() called while running; stop() it first")
        if self._cuda:
            assert self._events is not None
            self._events[1].synchronize()
            return float(self._events[0].elapsed_time(self._events[1])) / 1e3
        return self._t1 - self._t0


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak for :func:`peak_memory_bytes` (CUDA only: RSS peaks cannot reset)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


@dataclass(frozen=True)
class PeakMemory:
    """Peak memory of one process on its device.

    Attributes:
        kind: ``"cuda_max_allocated"`` (``torch.cuda.max_memory_allocated``: what tensors
            held at most) on CUDA, ``"rss"`` (the process's peak resident set) elsewhere.
        bytes: the peak.
        reserved_bytes: CUDA only: ``torch.cuda.max_memory_reserved`` (the caching
            allocator's peak, what ``nvidia-smi`` sees); ``None`` elsewhere.
    """

    kind: str
    bytes: int
    reserved_bytes: int | None = None


def peak_memory_bytes(device: torch.device) -> PeakMemory:
    """Peak memory of this process on ``device`` (see :class:`PeakMemory`)."""
    if device.type == "cuda":
        return PeakMemory(
            "cuda_max_allocated",
            int(torch.cuda.max_memory_allocated(device)),
            int(torch.cuda.max_memory_reserved(device)),
        )
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is in KiB on Linux, in bytes on macOS
    return PeakMemory("rss", int(peak if sys.platform == "darwin" else peak * 1024))
