"""When each pipeline action ran on this rank, in seconds, on one clock for every device.

The trace (:meth:`~syncline.pipeline.Pipeline.trace`) needs each action's start and end on a
clock that the ranks of a machine share (``time.perf_counter``), so that a trainer can merge
the ranks' timelines (bubble, idle time). On the CPU an action's work is done when its
handler returns, so ``perf_counter`` around the handler is its interval. On CUDA the handler
only queues kernels: ``perf_counter`` would time the launches. There, as
:class:`syncline.comm.device.Stopwatch` does, each action records a CUDA event at its start
and end on the current stream, and the events are read only when they are done
(``Event.query()``, which never blocks) or when the trace is asked for. Events become
seconds on the host clock through one anchor: an event recorded once, at the first action,
waited for, and paired with ``perf_counter`` at that moment (a single host sync in the life
of the pipeline, not one per step); every later event's time is the anchor's plus
``anchor.elapsed_time(event)``.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from syncline.schedule import Action, Event


class ActionClock:
    """Start and end of each action, as :class:`~syncline.schedule.Event` (seconds on the
    ``perf_counter`` clock; see the module docstring).

    Args:
        device: where the actions' work runs.
        rank: the rank the events are of.
        maxlen: the most events kept (the oldest go first).
    """

    def __init__(self, device: torch.device, rank: int, maxlen: int = 200_000) -> None:
        self._cuda = device.type == "cuda"
        self._device = device
        self._rank = rank
        self._done: deque[Event] = deque(maxlen=maxlen)
        self._queued: deque[tuple[Action, torch.cuda.Event, torch.cuda.Event]] = deque()
        self._anchor: tuple[torch.cuda.Event, float] | None = None

    def start(self) -> float | torch.cuda.Event:
        """Mark an action's start (pass the result to :meth:`stop`)."""
        if not self._cuda:
            return time.perf_counter()
        with torch.cuda.device(self._device):
            if self._anchor is None:
                anchor = torch.cuda.Event(enable_timing=True)
                anchor.record()
                anchor.synchronize()  # once: ties the device clock to perf_counter
                self._anchor = (anchor, time.perf_counter())
            begin = torch.cuda.Event(enable_timing=True)
            begin.record()
        return begin

    def stop(self, action: Action, begin: float | torch.cuda.Event) -> None:
        """Mark the end of ``action`` started at ``begin``."""
        if isinstance(begin, float):
            self._done.append(Event(self._rank, action, begin, time.perf_counter()))
            return
        with torch.cuda.device(self._device):
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        self._queued.append((action, begin, end))
        self._resolve(wait=False)

    def _resolve(self, *, wait: bool) -> None:
        """Turn the recorded events into times, oldest first: those done (``wait``: all)."""
        while self._queued:
            action, begin, end = self._queued[0]
            if not wait and not end.query():
                return
            self._queued.popleft()
            assert self._anchor is not None
            anchor, at = self._anchor
            start = at + anchor.elapsed_time(begin) / 1e3
            self._done.append(Event(self._rank, action, start, at + anchor.elapsed_time(end) / 1e3))

    def events(self) -> list[Event]:
        """Every event kept, in order (on CUDA: waits for the last recorded ones)."""
        self._resolve(wait=True)
        return list(self._done)
