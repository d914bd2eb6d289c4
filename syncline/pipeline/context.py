"""The state of one rank's pipeline that its action handlers and its call loop work on.

Each handler is a function ``handler(action, ctx)`` (:mod:`syncline.pipeline.actions`), run by
the call loop (:mod:`syncline.pipeline.calls`) on one :class:`PipelineContext` that
:class:`~syncline.pipeline.runtime.Pipeline` builds, as torch.distributed.pipelining runs its
actions on a ``_PipelineContext``: every piece of state the handlers share is declared here,
once, whoever reads or writes it, instead of on a class split over mixins.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from syncline.pipeline.batches import Batch
from syncline.pipeline.links import Links
from syncline.pipeline.precision import PipelinePrecision
from syncline.pipeline.replicas import StageReplicas
from syncline.pipeline.stage import Stage
from syncline.pipeline.tied import TiedGradients
from syncline.schedule import Action, ActionKind

#: a message between two actions of this rank: (kind of the action that made or received it,
#: stage, global batch, micro-batch)
InboxKey = tuple[ActionKind, int, int, int]


@dataclass(eq=False)
class PipelineContext:
    """What this rank's handlers share: fixed when the pipeline is constructed, set when its
    stages are built (:mod:`syncline.pipeline.setup`), or renewed by each call.

    Attributes:
        rank: this rank in the pipeline's group.
        num_stages: the pipeline's depth ``d``.
        last_rank: the rank of stage ``d - 1``, which sends the batch loss to the others.
        device: where the stages compute.
        recompute: a FORWARD keeps only its stage's input; a RECOMPUTE replays it.
        links: the messages of the SEND/RECV actions and of the loss.
        precision: autocast and fp16's loss scale, shared by every stage of the rank.
        replicas: the link to the data-parallel replicas of this rank's stages (``None``:
            a single pipeline).
        stages: this rank's stages by index, once built.
        tied: the gradient sums of weights shared across stages (a model split at named
            modules), once built; ``None`` otherwise.
        inbox: messages waiting between two actions: received ones (RECV_F, RECV_B) and the
            outputs of a FORWARD or BACKWARD waiting for their SEND.
        batches: the batches of the current call by global index (the one it finishes, and
            under 2BW the next one it starts).
        final: the current call's backwards that start their stage's REDUCE inside them
            (replicas only: :func:`syncline.pipeline.actions.final_backwards`).
        call: the current call's number, from 1 (the sends of each call are waited for by it).
        broken: why the pipeline stopped (a failure leaves its stages mid-batch); ``None``
            while it is usable.
    """

    rank: int
    num_stages: int
    last_rank: int
    device: torch.device
    recompute: bool
    links: Links
    precision: PipelinePrecision
    replicas: StageReplicas | None
    stages: dict[int, Stage] = field(default_factory=dict)
    tied: TiedGradients | None = None
    inbox: dict[InboxKey, torch.Tensor] = field(default_factory=dict)
    batches: dict[int, Batch] = field(default_factory=dict)
    final: set[Action] = field(default_factory=set)
    call: int = 0
    broken: str | None = None
