"""What a :class:`~syncline.pipeline.Pipeline` reports about its own run: the bytes it sent,
the memory its stages stashed, and the timeline of the actions it executed.

Kept apart from the runtime, which runs the actions; these only read what it recorded.
"""

from __future__ import annotations

from syncline.pipeline.links import Links
from syncline.pipeline.memory import StageMemoryStats
from syncline.pipeline.replicas import StageReplicas
from syncline.pipeline.stage import Stage
from syncline.pipeline.timing import ActionClock
from syncline.schedule import Event, Plan, Timeline


class PipelineReports:
    """The reporting half of :class:`~syncline.pipeline.Pipeline`."""

    _links: Links
    _replicas: StageReplicas | None
    _stages: dict[int, Stage]
    _clock: ActionClock
    _plan: Plan
    _rank: int

    @property
    def stages(self) -> list[int]:
        raise NotImplementedError

    def _require_setup(self) -> None:
        raise NotImplementedError

    @property
    def wire_bytes(self) -> dict[str, int]:
        """Payload bytes this rank has sent so far: ``activations``, ``gradients`` (to the
        neighbouring stages) and ``reduce`` (to its replicas, as compressed)."""
        reduce = 0 if self._replicas is None else self._replicas.wire_bytes
        return {**self._links.sent, "reduce": reduce}

    @property
    def early_reduce_buckets(self) -> int:
        """REDUCE buckets started inside a backward, before their REDUCE action (replicas
        only): how much of the replicas' averaging overlapped the last backward."""
        return 0 if self._replicas is None else self._replicas.early_buckets

    def memory_stats(self) -> dict[int, StageMemoryStats]:
        """Per local stage: peak stashed activations and weight versions (measured)."""
        self._require_setup()
        return {s: self._stages[s].memory_stats() for s in self.stages}

    def reset_memory_stats(self) -> None:
        for stage in self._stages.values():
            stage.reset_memory_stats()

    def trace(self, *, origin: float | None = None) -> Timeline:
        """This rank's executed actions as a :class:`~syncline.schedule.Timeline`, in seconds.

        Times are ``time.perf_counter()`` minus ``origin`` (default: this rank's first
        start); on CUDA each action's interval is that of its work on the device, from CUDA
        events placed on the same clock (:mod:`syncline.pipeline.timing`; reading them waits
        for the last ones). On Linux that clock is shared by the processes of a machine, so a
        trainer can gather ``trace(origin=0.0)`` from every rank, subtract the smallest start
        and merge the events; ``to_chrome_trace(timeline, us_per_unit=1e6)`` writes it.
        """
        events = self._clock.events()
        base = origin if origin is not None else (events[0].start if events else 0.0)
        shifted = tuple(Event(e.rank, e.action, e.start - base, e.end - base) for e in events)
        return Timeline(self._plan.name, {self._rank: shifted})
