"""What each action of a pipeline schedule does on this rank: one function per ``ActionKind``.

Each handler takes the action and the rank's :class:`~syncline.pipeline.context.PipelineContext`
(``handler(action, ctx)``) and only does its action's work on that state: received tensors
wait in the context's inbox, keyed by kind, stage, batch and micro-batch. Which actions a call
runs, in what order (the generator's), how each is timed and how a failure is named is the
call loop's (:mod:`syncline.pipeline.calls`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

import torch

from syncline.pipeline.batches import to_device
from syncline.pipeline.context import PipelineContext
from syncline.pipeline.links import Like, Links
from syncline.pipeline.stage import Stage
from syncline.schedule import Action, ActionKind

K = ActionKind
#: ``handler(action, ctx)``: one action's work on this rank's state
Handler = Callable[[Action, PipelineContext], None]


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


def recv(a: Action, ctx: PipelineContext) -> None:
    """gloo: take the message now. Grouped (NCCL): its group was issued at the first action
    of its run (:func:`issue`); the compute that needs it waits for it."""
    if not ctx.links.grouped:
        ctx.inbox[Links.key(a)] = ctx.links.recv(a)


def _received(kind: ActionKind, a: Action, ctx: PipelineContext) -> torch.Tensor:
    """The message of ``a``'s micro-batch that the RECV of ``kind`` brought."""
    action = Action(a.stage, kind, a.microbatch, batch=a.batch)
    got = ctx.inbox.pop(Links.key(action), None)
    return ctx.links.recv(action) if got is None else got


def _outgoing(a: Action, ctx: PipelineContext) -> tuple[torch.Tensor, Like | None]:
    """A SEND's message, and for a SEND_F the shape of the gradient that comes back."""
    assert a.batch is not None and a.microbatch is not None
    forward = a.kind is K.SEND_F
    source = K.FORWARD if forward else K.BACKWARD
    message = ctx.inbox.pop((source, a.stage, a.batch, a.microbatch))
    return message, ctx.stages[a.stage].grad_like(message) if forward else None


def send(a: Action, ctx: PipelineContext) -> None:
    if not ctx.links.grouped:  # grouped: sent with its run (:func:`issue`)
        message, grad_like = _outgoing(a, ctx)
        ctx.links.send(a, message, ctx.call, grad_like)


def issue(actions: Sequence[Action], ctx: PipelineContext) -> None:
    """Grouped (NCCL): a run of SEND/RECV actions as one group, at its first action."""
    outgoing = {a: _outgoing(a, ctx) for a in actions if a.kind in (K.SEND_F, K.SEND_B)}
    ctx.links.issue(actions, outgoing, ctx.call)


def forward(a: Action, ctx: PipelineContext) -> None:
    assert a.batch is not None and a.microbatch is not None
    batch, mb = ctx.batches[a.batch], a.microbatch
    stage = ctx.stages[a.stage]
    received = None if stage.first else _received(K.RECV_F, a, ctx)
    part = to_device(batch.inputs[mb], ctx.device) if stage.traced or stage.first else None
    x: torch.Tensor | None = received
    inputs: Mapping[str, torch.Tensor] | None = None
    if isinstance(part, torch.Tensor):  # stage 0 of an nn.Sequential
        x = part
    elif part is not None:  # a traced stage reads the model inputs it needs
        inputs = part
    target = batch.targets[mb].to(ctx.device) if stage.last else None
    out = stage.forward((a.batch, mb), x, a.version, target, recompute=ctx.recompute, inputs=inputs)
    if out is not None:
        ctx.inbox[(K.FORWARD, a.stage, a.batch, mb)] = out


def recompute(a: Action, ctx: PipelineContext) -> None:
    assert a.batch is not None and a.microbatch is not None
    ctx.stages[a.stage].recompute((a.batch, a.microbatch))


def backward(a: Action, ctx: PipelineContext) -> None:
    assert a.batch is not None and a.microbatch is not None
    stage = ctx.stages[a.stage]
    grad = None if stage.last else _received(K.RECV_B, a, ctx)
    if a in ctx.final:  # the batch's last backward here: its REDUCE starts inside
        assert ctx.replicas is not None
        ctx.replicas.arm(a.stage, a.batch, stage.grad_holders(a.batch))
        try:
            grad_in = stage.backward((a.batch, a.microbatch), grad)
        finally:  # the hooks are for this one backward, failed or not
            ctx.replicas.disarm()
    else:
        grad_in = stage.backward((a.batch, a.microbatch), grad)
    if grad_in is not None:
        ctx.inbox[(K.BACKWARD, a.stage, a.batch, a.microbatch)] = grad_in


def reduce(a: Action, ctx: PipelineContext) -> None:
    """Average the stage's gradient of ``a.batch`` over its replicas (nothing without)."""
    assert a.batch is not None
    stage = ctx.stages[a.stage]
    if ctx.replicas is not None:
        ctx.replicas.reduce(a.stage, a.batch, stage.grad_holders(a.batch))
    if ctx.tied is not None and ctx.tied.groups_of(a.stage):
        # after the (maybe lossy) average, so that every copy adds the same values
        named = stage.named_grad_holders(a.batch)
        holders = {k.removeprefix("stage."): v for k, v in named.items()}
        ctx.tied.sum(a.stage, a.batch, holders)


def step(a: Action, ctx: PipelineContext) -> None:
    assert a.batch is not None
    stage, batch, precision = ctx.stages[a.stage], a.batch, ctx.precision
    if precision.scaler is None:  # nothing to unscale or agree on
        stage.step(batch, a.version, before=lambda: True)
        return

    def grads(stages: list[Stage]) -> list[torch.Tensor]:
        return [p.grad for s in stages for p in s.module.parameters() if p.grad is not None]

    def before() -> bool:  # the stage's gradient is on its Parameters now; the first
        # STEP of a batch checks this rank's other stages (interleaved) too
        every = list(ctx.stages.values())
        return precision.before_step(batch, grads([stage]), lambda: grads(every))

    stage.step(batch, a.version, before=before)


#: the handler of each kind of action
HANDLERS: Mapping[ActionKind, Handler] = MappingProxyType(
    {
        K.RECV_F: recv,
        K.RECV_B: recv,
        K.FORWARD: forward,
        K.SEND_F: send,
        K.RECOMPUTE: recompute,
        K.BACKWARD: backward,
        K.SEND_B: send,
        K.REDUCE: reduce,
        K.STEP: step,
    }
)


def broadcast_loss(batch: int, ctx: PipelineContext) -> torch.Tensor:
    """Every rank gets the batch loss from the last stage, as a float64 ``[1]`` on the
    device (read on the host only by whoever logs it). The last stage does not wait for the
    others to take it (its sends complete during its next call), so it can go on with the
    next batch while the first stage finishes this one; on gloo the others posted the
    receive when the call began (:meth:`Links.expect_loss`)."""
    last = ctx.stages.get(ctx.num_stages - 1)
    if last is None:
        return ctx.links.recv_loss(batch, ctx.last_rank)
    value = last.pop_loss(batch)
    if ctx.replicas is not None:
        ctx.replicas.average_loss(value, batch)
    ctx.links.send_loss(value, batch, ctx.call)
    return value
