"""Pipeline parallelism: GPipe, 1F1B, PipeDream-2BW and interleaved 1F1B over torch.distributed.

Layers, lowest first: :mod:`~syncline.pipeline.config` (pure: the settings, checked against
the schedule registry; the call slices come from :mod:`syncline.schedule.plan`);
:mod:`~syncline.pipeline.memory` (measures stashed activations);
:mod:`~syncline.pipeline.versions` (2BW's two weight versions);
:mod:`~syncline.pipeline.batches` (micro-batches); :mod:`~syncline.pipeline.split`
(stage modules); :mod:`~syncline.pipeline.stage` (one stage's forward, recompute, backward,
step);
:mod:`~syncline.pipeline.profile` (layer times for :mod:`syncline.partition`);
:mod:`~syncline.pipeline.replicas` (REDUCE over a stage's data-parallel replicas);
:mod:`~syncline.pipeline.checks` (argument checks);
:mod:`~syncline.pipeline.shapes` (each boundary's message inferred on fake tensors);
:mod:`~syncline.pipeline.links` (messages: gloo's early receives, NCCL's groups);
:mod:`~syncline.pipeline.timing` (each action's interval, CUDA events on a GPU);
:mod:`~syncline.pipeline.context` (the per-rank state the handlers share);
:mod:`~syncline.pipeline.actions` (one ``handler(action, ctx)`` per action kind);
:mod:`~syncline.pipeline.calls` (one call's loop); :mod:`~syncline.pipeline.setup` (the stages
built once, by the first call that needs them); :mod:`~syncline.pipeline.reports` (bytes,
memory, timeline) and :mod:`~syncline.pipeline.runtime` (the API, composing them; it talks
through :mod:`syncline.comm`).

Names are resolved lazily, so that the pure planner imports without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Pipeline": "syncline.pipeline.runtime",
    "PipelineConfig": "syncline.pipeline.config",
    "PipelineSettings": "syncline.pipeline.config",
    "StageError": "syncline.pipeline.runtime",
    "StageMemoryStats": "syncline.pipeline.memory",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'syncline.pipeline' has no attribute {name!r}")
