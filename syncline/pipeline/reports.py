"""What a pipeline reports about its own run, read from its context: the bytes it sent, the
memory its stages stashed, and the timeline of the actions it executed.

Kept apart from the runtime, which runs the actions; these only read what it recorded.
:class:`~syncline.pipeline.Pipeline`'s ``wire_bytes``, ``early_reduce_buckets``,
``memory_stats``, ``reset_memory_stats`` and ``trace`` return them.
"""

from __future__ import annotations

from collections.abc import Sequence

from syncline.pipeline.context import PipelineContext
from syncline.pipeline.memory import StageMemoryStats
from syncline.pipeline.timing import ActionClock
from syncline.schedule import Event, Timeline


def wire_bytes(ctx: PipelineContext) -> dict[str, int]:
    """Payload bytes sent so far: to the neighbouring stages, and to the replicas."""
    reduce = 0 if ctx.replicas is None else ctx.replicas.wire_bytes
    return {**ctx.links.sent, "reduce": reduce}


def early_reduce_buckets(ctx: PipelineContext) -> int:
    """REDUCE buckets started inside a backward, in all (0 without replicas)."""
    return 0 if ctx.replicas is None else ctx.replicas.early_buckets


def memory_stats(ctx: PipelineContext, stages: Sequence[int]) -> dict[int, StageMemoryStats]:
    """Per stage of ``stages`` (built): what it stashed at its peak."""
    return {s: ctx.stages[s].memory_stats() for s in stages}


def reset_memory_stats(ctx: PipelineContext) -> None:
    for stage in ctx.stages.values():
        stage.reset_memory_stats()


def timeline(clock: ActionClock, name: str, rank: int, origin: float | None) -> Timeline:
    """The actions ``clock`` recorded on ``rank`` of schedule ``name``, shifted by
    ``origin`` (default: the first start)."""
    events = clock.events()
    base = origin if origin is not None else (events[0].start if events else 0.0)
    shifted = tuple(Event(e.rank, e.action, e.start - base, e.end - base) for e in events)
    return Timeline(name, {rank: shifted})
