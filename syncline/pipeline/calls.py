"""One call of the pipeline runtime: this rank's slice of the schedule, action by action.

Kept apart from :mod:`syncline.pipeline.runtime` (the public API and the setup) and from
:mod:`syncline.pipeline.actions` (what each action does): a call relabels its slice with the
global batch number, runs each action through its handler, times it
(:mod:`syncline.pipeline.timing`) and turns a failure into an error naming the rank, the
stage, the step and the action; it ends by finishing earlier sends and broadcasting the loss.

Under NCCL (the grouped path of :mod:`syncline.pipeline.links`) a call also issues each run
of SEND/RECV actions as one group at its first action
(:func:`syncline.schedule.nccl.p2p_batches`), and before its first REDUCE posts the receives
of what the other ranks send it in this call for the next one (2BW's early forwards), in
their order, so that every later message on each pair comes after them on both sides.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from syncline.errors import CommError
from syncline.pipeline.actions import ActionHandlers, final_backwards
from syncline.pipeline.batches import Batch
from syncline.pipeline.links import RECVS, SENDS, Links, Signature
from syncline.pipeline.shapes import BoundaryShapes, Like
from syncline.pipeline.timing import ActionClock
from syncline.schedule import Action, ActionKind, Plan, Segment
from syncline.schedule.nccl import nccl_plan, p2p_batches

K = ActionKind


class StageError(RuntimeError):
    """A stage failed while executing an action; the message names rank, step and action."""


class CallRunner(ActionHandlers):
    """The call loop of :class:`~syncline.pipeline.runtime.Pipeline`."""

    _plan: Plan
    _rank: int
    _connected: bool
    _ahead: dict[str, list[tuple[int, ActionKind, int, int]]]
    _clock: ActionClock
    _broken: str | None
    _handlers: dict[ActionKind, Callable[[Action], None]]
    _boundaries: BoundaryShapes | None

    def _use_grouped(self, *, ordered: bool = True) -> None:
        """Run the NCCL protocol on any backend (tests on gloo, before the first call): the
        plan in NCCL's order, each run of SEND/RECV as one group, inferred shapes, and with
        ``ordered`` one wire tag, so that gloo pairs messages in issue order as NCCL does."""
        self._plan = nccl_plan(self._plan)
        self._links.use_grouped(ordered=ordered)

    def _infer(self, edge: int, signature: Signature) -> Like | None:
        """The inferred message of boundary ``edge`` (see :mod:`syncline.pipeline.shapes`)."""
        return None if self._boundaries is None else self._boundaries.like(edge, signature)

    def _run_call(self, segment: Segment, current: Batch, nxt: Batch | None) -> torch.Tensor:
        self._batches = {current.index: current}
        if nxt is not None:
            self._batches[nxt.index] = nxt
        actions = segment.at(self._rank, current.index)
        self._final = final_backwards(actions) if self._replicas is not None else set()
        self._call += 1
        grouped = self._links.grouped
        groups = dict(p2p_batches(actions)) if grouped else {}
        ahead = self._posted_ahead(segment, current.index) if grouped else []
        reduce_at = next((i for i, a in enumerate(actions) if a.kind is K.REDUCE), len(actions))
        try:
            if not self._connected:
                self._links.connect()
                self._connected = True
            self._links.expect_call(actions)
            if self._d - 1 not in self._stages:
                self._links.expect_loss(current.index, self._last_rank)
        except CommError as exc:
            self._broken = str(exc)
            raise
        for i, action in enumerate(actions):
            begin = self._clock.start()
            try:
                if i == reduce_at and ahead:
                    self._links.post_ahead(ahead, self._call)
                if i in groups:
                    self._issue(actions[i : groups[i]])
                self._links.progress()
                self._handlers[action.kind](action)
            except CommError as exc:
                self._broken = str(exc)
                raise
            except Exception as exc:  # a ConfigError (a shape) too: named, as its cause
                what = (
                    f"rank {self._rank} (stage {action.stage}): {action.kind.name} "
                    f"mb {action.microbatch} of step {action.batch} ({action}) failed: "
                    f"{type(exc).__name__}: {exc}"
                )
                self._broken = what
                raise StageError(what) from exc
            self._clock.stop(action, begin)
        try:
            if reduce_at == len(actions) and ahead:
                self._links.post_ahead(ahead, self._call)
            self._links.wait_sends(self._call, everything=segment.kind in ("drain", "single"))
            return self._broadcast_loss(current.index)
        except CommError as exc:
            self._broken = str(exc)
            raise

    def _posted_ahead(self, segment: Segment, batch: int) -> list[Action]:
        """The receives of the messages that other ranks send to this one in this call but
        that this rank takes in a later call (2BW's next batch), in their senders' order:
        posted before this call's first REDUCE (:meth:`Links.post_ahead`)."""
        if segment.kind not in self._ahead:
            mine = {Links.key(a) for a in segment.at(self._rank, batch) if a.kind in RECVS}
            found = []
            for rank in range(self._plan.num_ranks):
                for a in segment.at(rank, batch) if rank != self._rank else ():
                    if a.kind not in SENDS or self._links.peer(a) != self._rank:
                        continue
                    forward = a.kind is K.SEND_F
                    kind, stage = (K.RECV_F, a.stage + 1) if forward else (K.RECV_B, a.stage - 1)
                    assert a.batch is not None and a.microbatch is not None
                    if (kind, stage, a.batch, a.microbatch) not in mine:
                        found.append((stage, kind, a.microbatch, a.batch - batch))
            self._ahead[segment.kind] = found
        found = self._ahead[segment.kind]
        return [Action(stage, kind, mb, batch=b + batch) for stage, kind, mb, b in found]
