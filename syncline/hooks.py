"""syncline's compressors as DDP communication hooks: ``ddp.register_comm_hook(state, hook)``.

Every framework that wraps torch's ``DistributedDataParallel`` (PyTorch Lightning, HuggingFace
Accelerate, a plain training loop) can then send CSC, TopK, fp16 or bf16 gradients (or
syncline's PowerSGD), with the arithmetic of :class:`~syncline.dp.DataParallel` to the bit
(``tests/dist/test_hooks.py`` holds it)::

    >>> state = HookState(CSC(0.01, warmup_steps=50))
    >>> ddp.register_comm_hook(state, hook)

The hook is a thin adapter: each DDP bucket goes to ``compressor.reduce`` as a
:class:`~syncline.dp.compression.BucketRef` (DDP's bucket index, :attr:`HookState.step`, the
parameters' offsets and shapes inside the bucket) over a
:class:`~syncline.comm.FlatAllreduce` of the state's process group. Where DDP differs from
DataParallel, the hook does this:

* **DDP re-cuts its buckets after its first backward** (torch 2.13 puts every parameter in
  one bucket at first, then buckets them in the order their gradients became ready). A
  compressor keeps residuals per bucket, so that first backward is reduced losslessly, as
  DataParallel's first step is for the same reason, and the compressor starts on the
  buckets DDP keeps. A compressor that owns the momentum (CSC) still receives that
  backward's local gradients (``absorb``) when it starts, so its momentum misses no step.
* **Futures.** A two-phase compressor (CSC: scores, then the chunks they select) issues its
  second collective from the training thread in an order every rank repeats
  (:class:`~syncline.dp.compressors._pending.PhaseOrder`); a future's callback runs on the
  backend's thread whenever the first one finishes, which could order them differently on
  two ranks. So each bucket's collectives start in its own hook (overlapping the rest of
  backward, as in DataParallel), waiting second phases are issued at each later hook, and
  every bucket's future is completed in the last bucket's hook, after which DDP waits for
  all of them anyway.
* **Checkpoints.** :meth:`HookState.state_dict` holds the step, the compressor's per-bucket
  state and which parameters each of its buckets holds (by position in DDP's first
  backward, whose one bucket lists them in registration order). Loaded into a state on a
  new DDP of the same model, the buckets of that DDP's first backward are cut into the
  saved ones, so training continues as if it had never stopped, bit for bit.

One state per DDP model and rank: the residuals are each rank's own, so each rank saves its
own state (as with :meth:`~syncline.dp.DataParallel.compression_state_dict`).
"""

# No ``from __future__ import annotations``: DDP's register_comm_hook compares the hook's
# annotations with the classes themselves and refuses names given as strings.

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from syncline.comm.collectives import FlatAllreduce, GradBucket, Pending, open_lane
from syncline.comm.groups import Group
from syncline.dp.compression import BucketRef, Compressor, Layout, NoCompression
from syncline.errors import ConfigError

__all__ = ["HookState", "hook"]

Shape = tuple[int, ...]


@dataclass
class _Backward:
    """One backward's bookkeeping, from its first bucket's hook to its last."""

    learning: bool
    """DDP's first backward over these parameters: positions are assigned by appearance."""
    adopting: bool
    """The compressor's first backward: DDP's buckets become the compressor's buckets."""
    futures: list[tuple[torch.futures.Future[torch.Tensor], torch.Tensor]] = field(
        default_factory=list
    )
    pending: list[tuple[Pending, Callable[[], None] | None]] = field(default_factory=list)
    arrived: dict[int, torch.Tensor] = field(default_factory=dict)
    """Position -> gradient, of the parameters in DDP buckets cut unlike the compressor's."""
    done: set[int] = field(default_factory=set)
    """The compressor's buckets reduced in this backward."""


class HookState:
    """What :func:`hook` keeps between calls: the compressor, where it sends, and the step.

    Args:
        compressor: a syncline compressor (:mod:`syncline.compression`: ``CSC``, ``TopK``,
            ``FP16``, ``BF16``, ``PowerSGD``, or one from the registry). It owns the
            momentum where it applies one (CSC): run the optimizer without momentum.
        process_group: the group the DDP model reduces over (``None``: the default group).
            Nothing is made here: the collective (and the second lane a two-phase
            compressor asks for, a new process group) is made at the first hook call, a
            point every rank reaches with nothing in flight.
        timeout_s: how long any wait for the other ranks may take before it fails with a
            message naming the rank, the bucket and the step.

    Attributes:
        step: backwards reduced so far; the step the compressor is told (its warm-up counts
            it), advanced at each backward's last bucket.
        buckets_reduced: DDP buckets the hook has reduced, over all steps.
        last_wire_bytes: bytes this rank handed to the network in the last backward.

    Raises:
        ConfigError: a ``compressor`` without ``reduce``/``state_dict``, or ``timeout_s <= 0``.

    Example:
        >>> state = HookState(CSC(0.01, warmup_steps=50))
        >>> ddp.register_comm_hook(state, hook)
        >>> torch.save({"model": model.state_dict(), "hook": state.state_dict()}, path)
    """

    def __init__(
        self, compressor: Compressor, process_group: Group = None, *, timeout_s: float = 300.0
    ) -> None:
        for method in ("reduce", "state_dict", "load_state_dict"):
            if not callable(getattr(compressor, method, None)):
                raise ConfigError(
                    f"HookState: {compressor!r} has no {method}(); pass a syncline compressor "
                    "(syncline.compression: CSC, TopK, FP16, BF16, PowerSGD)"
                )
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or timeout_s <= 0:
            raise ConfigError(f"HookState: timeout_s={timeout_s!r} must be a number > 0")
        self.compressor = compressor
        self.process_group = process_group
        self.timeout_s = float(timeout_s)
        self.step = 0
        self.buckets_reduced = 0
        self.last_wire_bytes = 0
        self._dense = NoCompression()
        self._poll: Callable[[], None] | None = getattr(compressor, "poll", None)
        self._comm: FlatAllreduce | None = None
        # each parameter's position in DDP's first backward, keyed by identity; the list
        # keeps the parameters alive, so that no id is reused by another tensor
        self._position: dict[int, int] = {}
        self._params: list[torch.Tensor] = []
        self._shapes: list[Shape] = []
        #: the compressor's buckets: index -> the positions of its parameters, in order
        self._buckets: dict[int, tuple[int, ...]] = {}
        self._backward: _Backward | None = None
        # a compressor that owns the momentum (CSC) gets the lossless first backward's local
        # gradients, by position, when it starts on DDP's buckets (as DataParallel's does)
        self._absorb: Callable[[int, torch.Tensor], None] | None = getattr(
            compressor, "absorb", None
        )
        self._first_local: dict[int, torch.Tensor] = {}

    def __repr__(self) -> str:
        return f"HookState({self.compressor!r}, step={self.step})"

    def state_dict(self) -> dict[str, Any]:
        """The step, the compressor's state and its buckets' parameters, for a checkpoint.

        Raises:
            ConfigError: called in the middle of a backward.
        """
        self._refuse_mid_backward("state_dict")
        return {
            "name": self.compressor.name,
            "step": self.step,
            "shapes": [list(s) for s in self._shapes],
            "buckets": {j: list(members) for j, members in self._buckets.items()},
            "compressor": self.compressor.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s result; the next backward continues from it.

        A state saved before it compressed anything (after DDP's first backward only) has no
        buckets yet; the new DDP's first backward is then lossless too, one step more than
        an uninterrupted run sends densely (and a compressor owning the momentum receives
        that backward's gradient, not the saved one's: it is not in the state).

        Raises:
            ConfigError: a checkpoint of another compressor, of a model with other
                parameters, or a call in the middle of a backward.
        """
        self._refuse_mid_backward("load_state_dict")
        if state.get("name") != self.compressor.name:
            raise ConfigError(
                f"HookState: checkpoint compressor {state.get('name')!r} != configured "
                f"{self.compressor.name!r}"
            )
        shapes = [tuple(int(n) for n in s) for s in state["shapes"]]
        mine = [tuple(p.shape) for p in self._params]
        if mine and mine != shapes:
            raise ConfigError(
                f"HookState: the checkpoint's parameters have shapes {shapes}, this state's "
                f"model {mine}; load it into the model it was saved from"
            )
        self.step = int(state["step"])
        self._shapes = shapes
        self._buckets = {
            int(j): tuple(int(q) for q in members) for j, members in state["buckets"].items()
        }
        self.compressor.load_state_dict(state["compressor"])

    def _refuse_mid_backward(self, what: str) -> None:
        if self._backward is not None:
            raise ConfigError(
                f"HookState.{what}() in the middle of a backward; call it between steps"
            )

    def _collective(self) -> FlatAllreduce:
        """The collective, made at the first hook call (with a lane if the compressor asks)."""
        if self._comm is None:
            flat = FlatAllreduce(self.process_group, timeout_s=self.timeout_s)
            if getattr(self.compressor, "wants_lane", False):
                open_lane(flat)
            self._comm = flat
        return self._comm

    def _begin(self, params: Sequence[torch.Tensor]) -> _Backward:
        """The first hook of a backward: a model this state has not met starts learning."""
        learning = not params or id(params[0]) not in self._position
        if learning:
            self._position, self._params, self._first_local = {}, [], {}
        self._backward = _Backward(learning, adopting=not learning and not self._buckets)
        return self._backward

    def _positions(self, params: Sequence[torch.Tensor], learning: bool, index: int) -> list[int]:
        """Each parameter's position; in a learning backward, the next free one."""
        out = []
        for p in params:
            pos = self._position.get(id(p))
            if pos is None:
                if not learning:
                    raise ConfigError(
                        f"HookState: DDP bucket {index} holds a parameter of shape "
                        f"{list(p.shape)} that this state did not meet in the first backward "
                        "it reduced; use one HookState per DDP model (a state moves to "
                        "another model only through state_dict/load_state_dict)"
                    )
                pos, shape = len(self._params), tuple(p.shape)
                if pos < len(self._shapes) and self._shapes[pos] != shape:
                    raise ConfigError(
                        f"HookState: parameter {pos} has shape {list(shape)} but the "
                        f"state's (loaded, or met before) has {list(self._shapes[pos])}; "
                        "load a state into the model it was saved from"
                    )
                if pos == len(self._shapes):
                    self._shapes.append(shape)
                self._position[id(p)] = pos
                self._params.append(p)
            out.append(pos)
        return out

    def _submit(
        self,
        compressor: Compressor,
        ref: BucketRef,
        grad: torch.Tensor,
        then: Callable[[], None] | None = None,
    ) -> None:
        assert self._backward is not None
        pending = compressor.reduce(ref, grad, self._collective())
        self._backward.pending.append((pending, then))
        if compressor is self.compressor:
            self._backward.done.add(ref.index)


def hook(state: HookState, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Reduce one DDP bucket with ``state``'s compressor; register with
    ``ddp.register_comm_hook(state, hook)`` (or a framework's ``ddp_comm_hook=hook,
    ddp_comm_state=state``).

    Returns:
        A future of the bucket's rank-averaged buffer, completed in the hook of the
        backward's last bucket (see the module's docstring for why).

    Raises:
        ConfigError: a bucket holds parameters the state cannot place (another model, a
            checkpoint of another model); every bucket's future then carries the error.
    """
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    try:
        _reduce(state, bucket, future)
        if bucket.is_last():
            _finish(state)
    except BaseException as exc:
        _abandon(state, exc)
        raise
    return future


def _reduce(
    state: HookState, bucket: GradBucket, future: torch.futures.Future[torch.Tensor]
) -> None:
    """Start one bucket: lossless while DDP's buckets are provisional, the compressor on its
    own buckets otherwise (DDP's, or the saved ones a DDP bucket is cut into)."""
    params = bucket.parameters()
    state._collective()  # made at the first hook: no collective of this state is in flight
    backward = state._backward or state._begin(params)
    index, buffer = bucket.index(), bucket.buffer()
    positions = state._positions(params, backward.learning, index)
    backward.futures.append((future, buffer))
    state.buckets_reduced += 1
    if state._poll is not None:  # issue the second phases whose first is done (no wait)
        state._poll()
    shapes = [tuple(p.shape) for p in params]
    layout = _layout(shapes)
    if layout and layout[-1][0] + math.prod(layout[-1][1]) != buffer.numel():
        raise ConfigError(
            f"HookState: DDP bucket {index} has {buffer.numel()} elements but its parameters "
            f"{[list(s) for s in shapes]} do not fill it back to back"
        )
    ref = BucketRef(index, state.step, layout)
    if backward.learning and not state._buckets:  # DDP re-cuts these buckets: lossless
        if state._absorb is not None:  # this rank's gradient, before it is averaged in place
            for pos, (offset, shape) in zip(positions, layout, strict=True):
                state._first_local[pos] = buffer[offset : offset + math.prod(shape)].clone()
        state._submit(state._dense, ref, buffer)
    elif backward.adopting and index not in state._buckets:
        state._buckets[index] = tuple(positions)
        if state._absorb is not None and state._first_local:
            state._absorb(index, torch.cat([state._first_local.pop(q) for q in positions]))
        state._submit(state.compressor, ref, buffer)
    elif state._buckets.get(index) == tuple(positions) and index not in backward.done:
        state._submit(state.compressor, ref, buffer)
    else:
        _recut(state, backward, buffer, layout, positions)


def _recut(
    state: HookState,
    backward: _Backward,
    buffer: torch.Tensor,
    layout: Layout,
    positions: list[int],
) -> None:
    """A DDP bucket cut unlike the compressor's buckets (DDP's first backward after a
    checkpoint was loaded): each of the compressor's buckets whose parameters have all
    arrived is gathered, reduced under its own index, and scattered back when done."""
    for pos, (offset, shape) in zip(positions, layout, strict=True):
        backward.arrived[pos] = buffer[offset : offset + math.prod(shape)]
    for j in sorted(state._buckets):
        members = state._buckets[j]
        if j in backward.done or not all(q in backward.arrived for q in members):
            continue
        grads = [backward.arrived[q] for q in members]  # flat views into DDP's buffers
        flat = torch.cat(grads)

        def scatter(grads: list[torch.Tensor] = grads, flat: torch.Tensor = flat) -> None:
            torch._foreach_copy_(grads, list(flat.split([g.numel() for g in grads])))

        ref = BucketRef(j, state.step, _layout([state._shapes[q] for q in members]))
        state._submit(state.compressor, ref, flat, scatter)


def _finish(state: HookState) -> None:
    """The last bucket: wait for every bucket in order, then complete the futures."""
    backward = state._backward
    assert backward is not None
    missing = sorted(set(state._buckets) - backward.done)
    covered = {q for j in backward.done for q in state._buckets[j]}
    stray = sorted(set(backward.arrived) - covered)
    if missing or stray:
        raise ConfigError(
            f"HookState: DDP's buckets do not hold the parameters of the compressor's buckets "
            f"(buckets {missing} incomplete, parameters {stray} in none of them); load a "
            "state into the model it was saved from"
        )
    if backward.learning and len(state._params) != len(state._shapes):
        raise ConfigError(
            f"HookState: the model has {len(state._params)} parameters with gradients, the "
            f"checkpoint {len(state._shapes)}; load the state into the model it was saved from"
        )
    for pending, then in backward.pending:
        pending.wait()
        if then is not None:
            then()
    for future, buffer in backward.futures:
        future.set_result(buffer)
    state.last_wire_bytes = sum(p.wire_bytes for p, _ in backward.pending)
    state.step += 1
    state._backward = None


def _abandon(state: HookState, exc: BaseException) -> None:
    """A hook failed: every future of this backward not yet completed carries the error, so
    that DDP's wait raises rather than hangs."""
    backward, state._backward = state._backward, None
    for future, _ in backward.futures if backward is not None else ():
        if not future.done():
            future.set_exception(exc)  # type: ignore[arg-type]  # torch's stub types it T


def _layout(shapes: Sequence[Shape]) -> Layout:
    """``(offset, shape)`` of each parameter laid back to back, as in a bucket."""
    out, offset = [], 0
    for shape in shapes:
        out.append((offset, shape))
        offset += math.prod(shape)
    return tuple(out)
