"""One call of the pipeline runtime: this rank's slice of the schedule, action by action.

Kept apart from :mod:`syncline.pipeline.runtime` (the public API and the batches it takes)
and from :mod:`syncline.pipeline.actions` (what each action does): a call relabels its slice
with the global batch number, runs each action through its handler on the rank's
:class:`~syncline.pipeline.context.PipelineContext`, times it
(:mod:`syncline.pipeline.timing`) and turns a failure into an error naming the rank, the
stage, the step and the action; it ends by finishing earlier sends and broadcasting the loss.

Under NCCL (the grouped path of :mod:`syncline.pipeline.links`) a call also issues each run
of SEND/RECV actions as one group at its first action
(:func:`syncline.schedule.nccl.p2p_batches`), and before its first REDUCE posts the receives
of what the other ranks send it in this call for the next one (2BW's early forwards), in
their order, so that every later message on each pair comes after them on both sides.
"""

from __future__ import annotations

import torch

from syncline.errors import CommError
from syncline.pipeline.actions import HANDLERS, broadcast_loss, final_backwards, issue
from syncline.pipeline.batches import Batch
from syncline.pipeline.context import PipelineContext
from syncline.pipeline.links import RECVS, SENDS, Links
from syncline.pipeline.timing import ActionClock
from syncline.schedule import Action, ActionKind, Segment
from syncline.schedule.nccl import p2p_batches

K = ActionKind


class StageError(RuntimeError):
    """A stage failed while executing an action; the message names rank, step and action."""


class CallRunner:
    """Runs the calls of one rank's pipeline on its context (see the module docstring).

    Args:
        ctx: the rank's state, which the handlers work on; a failure is noted in its
            ``broken``.
        num_ranks: the pipeline group's size (the ranks whose sends 2BW's early receives
            match).
        clock: records each action's interval.
        connected: whether the pipeline's group needs no collective before its first group
            of sends and receives (gloo; NCCL needs one: :meth:`Links.connect`).
    """

    def __init__(
        self, ctx: PipelineContext, num_ranks: int, clock: ActionClock, *, connected: bool
    ) -> None:
        self.ctx = ctx
        self.clock = clock
        self._num_ranks = num_ranks
        self._connected = connected
        #: per kind of segment, the receives posted ahead (relative batch numbers)
        self._ahead: dict[str, list[tuple[int, ActionKind, int, int]]] = {}

    def run(self, segment: Segment, current: Batch, nxt: Batch | None) -> torch.Tensor:
        """Run ``segment`` on ``current`` (and 2BW's ``nxt``); returns the batch loss."""
        ctx = self.ctx
        ctx.batches = {current.index: current}
        if nxt is not None:
            ctx.batches[nxt.index] = nxt
        actions = segment.at(ctx.rank, current.index)
        ctx.final = final_backwards(actions) if ctx.replicas is not None else set()
        ctx.call += 1
        grouped = ctx.links.grouped
        groups = dict(p2p_batches(actions)) if grouped else {}
        ahead = self._posted_ahead(segment, current.index) if grouped else []
        reduce_at = next((i for i, a in enumerate(actions) if a.kind is K.REDUCE), len(actions))
        try:
            if not self._connected:
                ctx.links.connect()
                self._connected = True
            ctx.links.expect_call(actions)
            if ctx.num_stages - 1 not in ctx.stages:
                ctx.links.expect_loss(current.index, ctx.last_rank)
        except CommError as exc:
            ctx.broken = str(exc)
            raise
        for i, action in enumerate(actions):
            begin = self.clock.start()
            try:
                if i == reduce_at and ahead:
                    ctx.links.post_ahead(ahead, ctx.call)
                if i in groups:
                    issue(actions[i : groups[i]], ctx)
                ctx.links.progress()
                HANDLERS[action.kind](action, ctx)
            except CommError as exc:
                ctx.broken = str(exc)
                raise
            except Exception as exc:  # a ConfigError (a shape) too: named, as its cause
                what = (
                    f"rank {ctx.rank} (stage {action.stage}): {action.kind.name} "
                    f"mb {action.microbatch} of step {action.batch} ({action}) failed: "
                    f"{type(exc).__name__}: {exc}"
                )
                ctx.broken = what
                raise StageError(what) from exc
            self.clock.stop(action, begin)
        try:
            if reduce_at == len(actions) and ahead:
                ctx.links.post_ahead(ahead, ctx.call)
            ctx.links.wait_sends(ctx.call, everything=segment.kind in ("drain", "single"))
            return broadcast_loss(current.index, ctx)
        except CommError as exc:
            ctx.broken = str(exc)
            raise

    def _posted_ahead(self, segment: Segment, batch: int) -> list[Action]:
        """The receives of the messages that other ranks send to this one in this call but
        that this rank takes in a later call (2BW's next batch), in their senders' order:
        posted before this call's first REDUCE (:meth:`Links.post_ahead`)."""
        me, links = self.ctx.rank, self.ctx.links
        if segment.kind not in self._ahead:
            mine = {Links.key(a) for a in segment.at(me, batch) if a.kind in RECVS}
            found = []
            for rank in range(self._num_ranks):
                for a in segment.at(rank, batch) if rank != me else ():
                    if a.kind not in SENDS or links.peer(a) != me:
                        continue
                    forward = a.kind is K.SEND_F
                    kind, stage = (K.RECV_F, a.stage + 1) if forward else (K.RECV_B, a.stage - 1)
                    assert a.batch is not None and a.microbatch is not None
                    if (kind, stage, a.batch, a.microbatch) not in mine:
                        found.append((stage, kind, a.microbatch, a.batch - batch))
            self._ahead[segment.kind] = found
        found = self._ahead[segment.kind]
        return [Action(stage, kind, mb, batch=b + batch) for stage, kind, mb, b in found]
