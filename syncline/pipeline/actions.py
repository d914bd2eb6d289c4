"""What each action of a pipeline schedule does on this rank: one handler per ``ActionKind``.

Kept apart from :mod:`syncline.pipeline.runtime`, which decides which actions a call runs
and in what order (the generator's), times them and turns failures into errors naming the
rank, step and action; a handler only does its action's work on the state the runtime
holds (received tensors in an inbox keyed by kind, stage, batch and micro-batch).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from syncline.pipeline.batches import Batch, to_device
from syncline.pipeline.links import Like, Links
from syncline.pipeline.precision import PipelinePrecision
from syncline.pipeline.replicas import StageReplicas
from syncline.pipeline.stage import Stage
from syncline.pipeline.tied import TiedGradients
from syncline.schedule import Action, ActionKind

K = ActionKind


def final_backwards(actions: list[Action]) -> set[Action]:
    """The BACKWARD actions after which a REDUCE of the same stage and batch follows with no
    other BACKWARD of them between: each is that batch's last backward of that stage, so the
    REDUCE can start its buckets inside it (:mod:`syncline.pipeline.reduce_buckets`)."""
    last: dict[tuple[int, int | None], Action] = {}
    final = set()
    for a in actions:
        if a.kind is K.BACKWARD:
            last[(a.stage, a.batch)] = a
        elif a.kind is K.REDUCE and (a.stage, a.batch) in last:
            final.add(last.pop((a.stage, a.batch)))
    return final


class ActionHandlers:
    """The handlers :class:`~syncline.pipeline.runtime.Pipeline` dispatches to."""

    _batches: dict[int, Batch]
    _stages: dict[int, Stage]
    _inbox: dict[tuple[ActionKind, int, int, int], torch.Tensor]
    _links: Links
    _call: int
    _device: torch.device
    _recompute: bool
    _replicas: StageReplicas | None
    _tied: TiedGradients | None
    _precision: PipelinePrecision
    _d: int
    _last_rank: int
    _final: set[Action]

    def _signature(self, a: Action) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype of the micro-batch input behind ``a`` (known on every rank)."""
        assert a.batch is not None and a.microbatch is not None
        x = self._batches[a.batch].inputs[a.microbatch]
        if isinstance(x, torch.Tensor):
            return tuple(x.shape), x.dtype
        first = next(iter(x.values()))  # traced: one shape per input, fixed by the trace
        return tuple(first.shape), first.dtype

    def _recv(self, a: Action) -> None:
        """gloo: take the message now. Grouped (NCCL): its group was issued at the first
        action of its run (:meth:`_issue`); the compute that needs it waits for it."""
        if not self._links.grouped:
            self._inbox[Links.key(a)] = self._links.recv(a)

    def _received(self, kind: ActionKind, a: Action) -> torch.Tensor:
        """The message of ``a``'s micro-batch that the RECV of ``kind`` brought."""
        recv = Action(a.stage, kind, a.microbatch, batch=a.batch)
        got = self._inbox.pop(Links.key(recv), None)
        return self._links.recv(recv) if got is None else got

    def _outgoing(self, a: Action) -> tuple[torch.Tensor, Like | None]:
        """A SEND's message, and for a SEND_F the shape of the gradient that comes back."""
        assert a.batch is not None and a.microbatch is not None
        forward = a.kind is K.SEND_F
        source = K.FORWARD if forward else K.BACKWARD
        message = self._inbox.pop((source, a.stage, a.batch, a.microbatch))
        return message, self._stages[a.stage].grad_like(message) if forward else None

    def _send(self, a: Action) -> None:
        if not self._links.grouped:  # grouped: sent with its run (:meth:`_issue`)
            message, grad_like = self._outgoing(a)
            self._links.send(a, message, self._call, grad_like)

    def _issue(self, actions: Sequence[Action]) -> None:
        """Grouped (NCCL): a run of SEND/RECV actions as one group, at its first action."""
        outgoing = {a: self._outgoing(a) for a in actions if a.kind in (K.SEND_F, K.SEND_B)}
        self._links.issue(actions, outgoing, self._call)

    def _forward(self, a: Action) -> None:
        assert a.batch is not None and a.microbatch is not None
        batch, mb = self._batches[a.batch], a.microbatch
        stage = self._stages[a.stage]
        received = None if stage.first else self._received(K.RECV_F, a)
        part = to_device(batch.inputs[mb], self._device) if stage.traced or stage.first else None
        x: torch.Tensor | None = received
        inputs: Mapping[str, torch.Tensor] | None = None
        if isinstance(part, torch.Tensor):  # stage 0 of an nn.Sequential
            x = part
        elif part is not None:  # a traced stage reads the model inputs it needs
            inputs = part
        target = batch.targets[mb].to(self._device) if stage.last else None
        out = stage.forward(
            (a.batch, mb), x, a.version, target, recompute=self._recompute, inputs=inputs
        )
        if out is not None:
            self._inbox[(K.FORWARD, a.stage, a.batch, mb)] = out

    def _recompute_action(self, a: Action) -> None:
        assert a.batch is not None and a.microbatch is not None
        self._stages[a.stage].recompute((a.batch, a.microbatch))

    def _backward(self, a: Action) -> None:
        assert a.batch is not None and a.microbatch is not None
        stage = self._stages[a.stage]
        grad = None if stage.last else self._received(K.RECV_B, a)
        if a in self._final:  # the batch's last backward here: its REDUCE starts inside
            assert self._replicas is not None
            self._replicas.arm(a.stage, a.batch, stage.grad_holders(a.batch))
            try:
                grad_in = stage.backward((a.batch, a.microbatch), grad)
            finally:  # the hooks are for this one backward, failed or not
                self._replicas.disarm()
        else:
            grad_in = stage.backward((a.batch, a.microbatch), grad)
        if grad_in is not None:
            self._inbox[(K.BACKWARD, a.stage, a.batch, a.microbatch)] = grad_in

    def _reduce(self, a: Action) -> None:
        """Average the stage's gradient of ``a.batch`` over its replicas (nothing without)."""
        assert a.batch is not None
        stage = self._stages[a.stage]
        if self._replicas is not None:
            self._replicas.reduce(a.stage, a.batch, stage.grad_holders(a.batch))
        if self._tied is not None and self._tied.groups_of(a.stage):
            # after the (maybe lossy) average, so that every copy adds the same values
            named = stage.named_grad_holders(a.batch)
            holders = {k.removeprefix("stage."): v for k, v in named.items()}
            self._tied.sum(a.stage, a.batch, holders)

    def _step(self, a: Action) -> None:
        assert a.batch is not None
        stage, batch, precision = self._stages[a.stage], a.batch, self._precision
        if precision.scaler is None:  # nothing to unscale or agree on
            stage.step(batch, a.version, before=lambda: True)
            return

        def grads(stages: list[Stage]) -> list[torch.Tensor]:
            return [p.grad for s in stages for p in s.module.parameters() if p.grad is not None]

        def before() -> bool:  # the stage's gradient is on its Parameters now; the first
            # STEP of a batch checks this rank's other stages (interleaved) too
            every = list(self._stages.values())
            return precision.before_step(batch, grads([stage]), lambda: grads(every))

        stage.step(batch, a.version, before=before)

    def _broadcast_loss(self, batch: int) -> torch.Tensor:
        """Every rank gets the batch loss from the last stage, as a float64 ``[1]`` on the
        device (read on the host only by whoever logs it). The last stage does not wait
        for the others to take it (its sends complete during its next call), so it can go
        on with the next batch while the first stage finishes this one; on gloo the others
        posted the receive when the call began (:meth:`Links.expect_loss`)."""
        last = self._stages.get(self._d - 1)
        if last is None:
            return self._links.recv_loss(batch, self._last_rank)
        value = last.pop_loss(batch)
        if self._replicas is not None:
            self._replicas.average_loss(value, batch)
        self._links.send_loss(value, batch, self._call)
        return value
