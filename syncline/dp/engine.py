"""DataParallel: a drop-in for DDP built on lazy allreduce over one flat gradient buffer.

How a step runs (GradientFlow's lazy allreduce, Sun et al. 2019; DDP's reducer, Li et al. 2020):

    forward    gradients set to None (``zero_grad()``): nothing to do; gradients kept (no_sync
               accumulation): each ``param.grad`` becomes a view into one flat buffer
    backward   a hook per parameter only marks it ready; when every parameter of the next
               bucket is ready, that bucket's fresh gradients are moved into their places in
               the buffer in one batched copy, and the bucket is handed to the compressor,
               which scales it and starts an asynchronous collective
    end        an autograd callback flushes the remaining buckets and waits only for what is
               still in flight; the buffer, which every ``param.grad`` now views, holds the
               rank-averaged gradients

Each gradient byte is written into the buffer once and never copied back (DDP copies into
its buckets and back out by default). Where the buffer is cut into buckets is measured during
the first steps, not guessed (:mod:`syncline.dp.tuning`). The bucket plan is pure data
(:mod:`syncline.dp.buckets`); the compressor and the collective algorithm are strategies, so
fp16/sparse compression and hierarchical allreduce plug in without touching the hooks.

This module is the ``nn.Module`` facade (DDP's signature, forward, buffer broadcast, state);
the buffer is :mod:`syncline.dp.layout`, the hooks and the backward :mod:`syncline.dp.reducer`,
and the bucket tuning :mod:`syncline.dp.autotune`.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NoReturn

import torch
from torch import nn

from syncline import comm
from syncline.comm.collectives import Collective
from syncline.comm.registry import build_allreduce
from syncline.dp.autotune import BucketTuning
from syncline.dp.buckets import BucketPlan
from syncline.dp.compression import Compressor, NoCompression
from syncline.dp.config import DataParallelConfig
from syncline.dp.layout import GradBuffer
from syncline.dp.reducer import Reducer, StepState, StepStats
from syncline.errors import ConfigError

__all__ = ["DataParallel", "StepStats"]

_D = DataParallelConfig()  # the defaults of syncline's own settings, written once there

# [Note: one live wrapper per module] A second DataParallel of a module takes over: the
# previous wrapper's hooks are removed and it refuses to run. Refusing the second one instead
# would break the commonest re-wrap, ``dp = DataParallel(net)`` run again (a notebook cell, a
# retry loop), where the old wrapper is still referenced by ``dp`` while the new one is built.
_OWNER: weakref.WeakKeyDictionary[nn.Module, weakref.ReferenceType[DataParallel]] = (
    weakref.WeakKeyDictionary()
)


class DataParallel(nn.Module):
    """Data parallelism over a process group; a training loop written for DDP works unchanged.

    Args:
        module: the model; every rank's parameters must match rank 0's in names, shapes and
            dtypes (checked here, before anything is sent, as DDP does); then its parameters
            and buffers are broadcast from rank 0, so all replicas start identical. A
            previous DataParallel of the same module stops working (its hooks are removed).
        device_ids, output_device, dim, check_reduction, static_graph: accepted for DDP
            compatibility; on CPU the device arguments are ignored.
        gradient_as_bucket_view: gradients are always views into the flat buffer; this
            chooses the memory, as in DDP. ``False`` (DDP's default): autograd's own gradient
            tensors, once copied into the buffer, are kept until the next forward (one extra
            gradient-sized set, like DDP's gradients beside its buckets; faster, see
            :meth:`forward`). ``True``: they are freed once their bucket is copied (DDP's
            lean mode).
        broadcast_buffers, process_group, bucket_cap_mb, find_unused_parameters: as in DDP
            (``broadcast_buffers=False`` also leaves the buffers out of the initial broadcast,
            as in DDP).
        first_bucket_cap_mb, rebuild_buckets, timeout_s: see :class:`DataParallelConfig`.
        compression: a :class:`~syncline.dp.compression.Compressor` (default: lossless).
        allreduce: ``"flat"`` or a :class:`~syncline.comm.Collective` (e.g. hierarchical).
        autotune_buckets: measure a few bucket plans during the first synchronised steps
            and keep the fastest (:mod:`syncline.dp.tuning`; the result is in
            :attr:`bucket_tuning`). ``None`` (default): on when neither cap is given and the
            compressor is stateless (lossless, fp16, bf16); DDP's sizes are the first
            candidate, and a few dozen steps settle it. Tuning never changes the
            result: only where the buffer is cut.
        tune_steps_per_trial, tune_rounds, tune_final_rounds, tune_keep_margin,
            tune_min_bucket_mb: see :class:`DataParallelConfig`.

    Raises:
        ConfigError: on invalid sizes, no trainable parameters, mixed parameter dtypes,
            parameters (or broadcast buffers) that differ across ranks (on every rank), or
            ``autotune_buckets=True`` with a compressor that keeps per-bucket state.

    Example:
        >>> model = DataParallel(net)              # after torch.distributed is initialised
        >>> loss_fn(model(x), y).backward()        # gradients are averaged over ranks
        >>> opt.step()
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: list[int] | None = None,
        output_device: int | None = None,
        dim: int = 0,
        broadcast_buffers: bool = True,
        process_group: comm.Group = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        *,
        first_bucket_cap_mb: float | None = None,
        rebuild_buckets: bool = _D.rebuild_buckets,
        timeout_s: float = _D.timeout_s,
        compression: Compressor | None = None,
        allreduce: str | Collective = "flat",
        autotune_buckets: bool | None = None,
        tune_steps_per_trial: int = _D.tune_steps_per_trial,
        tune_rounds: int = _D.tune_rounds,
        tune_final_rounds: int = _D.tune_final_rounds,
        tune_keep_margin: float = _D.tune_keep_margin,
        tune_min_bucket_mb: float = _D.tune_min_bucket_mb,
    ) -> None:
        super().__init__()
        del device_ids, output_device, dim, check_reduction, static_graph
        self._compressor: Compressor = compression or NoCompression()
        autotune_buckets = _autotune_choice(
            self._compressor,
            autotune_buckets,
            bucket_cap_mb is None and first_bucket_cap_mb is None,
        )
        self.config = DataParallelConfig(
            bucket_cap_mb=_D.bucket_cap_mb if bucket_cap_mb is None else bucket_cap_mb,
            first_bucket_cap_mb=first_bucket_cap_mb,
            broadcast_buffers=broadcast_buffers,
            find_unused_parameters=find_unused_parameters,
            rebuild_buckets=rebuild_buckets,
            timeout_s=timeout_s,
            autotune_buckets=autotune_buckets,
            tune_steps_per_trial=tune_steps_per_trial,
            tune_rounds=tune_rounds,
            tune_final_rounds=tune_final_rounds,
            tune_keep_margin=tune_keep_margin,
            tune_min_bucket_mb=tune_min_bucket_mb,
        )
        self.module = module
        self.process_group = process_group
        self._comm = _resolve_collective(allreduce, process_group, timeout_s)
        # first, so that a rank without trainable parameters fails on every rank too
        _check_same_on_all_ranks(module, broadcast_buffers, process_group, timeout_s)
        names, params = _trainable(module)

        # Same starting point on every rank (DDP semantics; the one side effect we must have).
        comm.broadcast_tensors(
            [p.data for p in module.parameters()]
            + (list(module.buffers()) if broadcast_buffers else []),
            group=process_group,
            what="initial parameter broadcast",
        )
        caps = (self.config.first_cap_bytes, self.config.cap_bytes)
        self._buf = GradBuffer(params, caps, keep_spent=not gradient_as_bucket_view)
        self._buf.install(list(reversed(range(len(params)))))  # backward runs roughly in reverse
        self._st = StepState(len(params))
        self._tuning = BucketTuning(self.config, self._buf, self._comm)
        self._reducer = Reducer(
            names=names,
            buffer=self._buf,
            state=self._st,
            config=self.config,
            compressor=self._compressor,
            collective=self._comm,
            group=process_group,
            tuning=self._tuning,
        )
        self._superseded = False
        previous = _OWNER.get(module)
        old = previous() if previous is not None else None
        if old is not None and old is not self:
            old._supersede()
        _OWNER[module] = weakref.ref(self)
        self.install_hooks()
        # the hooks hold the reducer, never this wrapper; once the wrapper is collected they
        # are removed (the finalizer holds only their handle list, which stays the same list)
        self._finalizer = weakref.finalize(self, _remove_handles, self._reducer.hooks)
        self._world_size = comm.group_size(process_group)
        self._sync_enabled = True
        self._buffer_bcast: comm.PackedBroadcast | None = None
        self._reducer.reset()

    @property
    def last_stats(self) -> StepStats:
        """What the last synchronised backward communicated."""
        return self._st.last_stats

    @property
    def bucket_plan(self) -> BucketPlan:
        """The current flat layout and buckets (pure data)."""
        return self._buf.plan

    @property
    def bucket_tuning(self) -> dict[str, Any] | None:
        """How the bucket sizes were chosen (``None`` until decided or when not tuned)."""
        return self._tuning.result

    @property
    def tuning_pending(self) -> bool:
        """True while the bucket sizes are still being measured (the same on every rank)."""
        return self._tuning.pending

    # -- forward ------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # Autograd's own gradient tensors, already copied into the buffer, are freed here
        # and not in the hooks: freed mid-backward, their memory went back to the allocator
        # while backward still allocated, and the model ran measurably slower (forward ~3 %
        # more CPU on the default GPT, with page faults in backward); freed now, right before
        # forward allocates, their memory is reused warm, as with DDP, whose gradients live
        # until zero_grad. The peak is DDP's too: one gradient-sized set beside the buffer.
        if self._superseded:
            self._refuse_superseded()
        self._buf.spent.clear()
        self.finish_buffer_sync()
        if not torch.is_grad_enabled():
            return self.module(*args, **kwargs)
        self._st.sync_this_backward = self._sync_enabled
        self._buf.attach_grads(lazy=True)
        out = self.module(*args, **kwargs)
        if self.config.broadcast_buffers and self._world_size > 1:
            self._start_buffer_sync()
        return out

    def _start_buffer_sync(self) -> None:
        """Send rank 0's buffers (as they are after this forward) to all, off the critical path.

        DDP broadcasts buffers synchronously *before* every forward. Buffers only change in
        forward (BatchNorm's running statistics), so sending them right *after* it carries the
        same values to the same next forward, while the message overlaps backward; receivers
        apply it at the end of backward (or at the next forward, whichever comes first).
        """
        if self._buffer_bcast is None:  # the buffers of the first training forward, as DDP
            buffers = list(self.module.buffers())  # none: every round completes at once
            self._buffer_bcast = comm.PackedBroadcast(
                buffers, group=self.process_group, timeout_s=self.config.timeout_s
            )
        self._st.buffer_sync = self._buffer_bcast.start(
            f"buffer broadcast at step {self._st.steps_synced}"
        )

    def finish_buffer_sync(self) -> None:
        """Apply a buffer broadcast still in flight (called before forward and after backward)."""
        self._st.finish_buffer_sync()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no communication) for forwards run inside."""
        old = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = old

    def sync_gradients(self) -> StepStats:
        """Average the whole gradient buffer now, bucket by bucket (outside any backward).

        Useful after accumulating under :meth:`no_sync` without a final synchronised
        backward, and for benchmarks that time the collective path alone.
        """
        return self._reducer.sync_all()

    # -- state --------------------------------------------------------------------------
    def compression_state_dict(self) -> dict[str, Any]:
        """The compressor's state (residuals, factors), for checkpoints."""
        return {
            "name": self._compressor.name,
            "steps_synced": self._st.steps_synced,
            "bucket_order": list(self._buf.plan.order),
            "state": self._compressor.state_dict(),
        }

    def load_compression_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("name") != self._compressor.name:
            raise ConfigError(
                f"checkpoint compressor {state.get('name')!r} != configured "
                f"{self._compressor.name!r}"
            )
        order = list(state["bucket_order"])
        if tuple(order) != self._buf.plan.order:
            self._buf.install(order, keep_grads=True)
            self._tuning.restart()  # its plans were cut for the old layout; tuning starts over
        self._st.steps_synced = int(state["steps_synced"])
        self._compressor.load_state_dict(state["state"])

    def install_hooks(self) -> None:
        """Attach the ready-hooks to the parameters (done at construction; again after
        :meth:`remove_hooks`). Idempotent."""
        if self._superseded:
            self._refuse_superseded()
        self._reducer.install_hooks()

    def remove_hooks(self) -> None:
        """Detach from the module's parameters (wrapping it again does this by itself)."""
        self._reducer.remove_hooks()

    def _supersede(self) -> None:
        """A newer DataParallel of the same module took over: detach and refuse to run."""
        self.remove_hooks()
        self._superseded = True

    def _refuse_superseded(self) -> NoReturn:
        raise ConfigError(
            "DataParallel: this wrapper was superseded by a newer DataParallel of the same "
            "module (its hooks are removed); use the newer one"
        )

    def __getstate__(self) -> NoReturn:
        # Unpickled, the wrapper would have no hooks and no process group: gradients would
        # silently stop being averaged. DDP pickles only partially; refusing is clearer.
        raise ConfigError(
            "DataParallel cannot be pickled or deep-copied (its gradient hooks and process "
            "group do not survive it): save model.module.state_dict() instead and wrap the "
            "loaded module again"
        )


def _autotune_choice(compressor: Compressor, requested: bool | None, no_cap_given: bool) -> bool:
    """Whether to tune the buckets: as ``requested``, or by default unless the user chose the
    sizes; only a compressor without per-bucket state may have its buckets re-cut."""
    stateless = getattr(compressor, "stateless", None)
    if not isinstance(stateless, bool):
        raise ConfigError(
            f"compression={compressor!r} does not declare 'stateless' (True or "
            "False: whether it keeps per-bucket state); see syncline.dp.Compressor"
        )
    if requested is None:  # tune unless the user chose the sizes
        return no_cap_given and stateless
    if requested and not stateless:
        raise ConfigError(
            f"autotune_buckets=True needs a stateless compressor (none, fp16, bf16); "
            f"{compressor.name!r} keeps per-bucket state, so its buckets must not "
            "change: pass bucket_cap_mb instead"
        )
    return requested


def _trainable(module: nn.Module) -> tuple[list[str], list[torch.Tensor]]:
    """The names and tensors of ``module``'s trainable parameters (at least one, one dtype)."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    if not named:
        raise ConfigError("DataParallel: the module has no parameter with requires_grad=True")
    dtypes = sorted({str(p.dtype) for _, p in named})
    if len(dtypes) > 1:
        raise ConfigError(f"DataParallel: trainable parameters mix dtypes {dtypes}; use one")
    return [n for n, _ in named], [p for _, p in named]


def _remove_handles(handles: list[Any]) -> None:
    """Remove hook handles (the finalizer of a collected wrapper; must not reference it)."""
    for h in handles:
        h.remove()
    handles.clear()


Signature = list[tuple[str, tuple[int, ...], str]]


def _signature(named: Sequence[tuple[str, torch.Tensor]]) -> Signature:
    return [(n, tuple(t.shape), str(t.dtype)) for n, t in named]


def _check_same_on_all_ranks(
    module: nn.Module, broadcast_buffers: bool, group: comm.Group, timeout_s: float
) -> None:
    """Compare every rank's trainable parameters (DDP's ``_verify_param_shape_across_processes``)
    and the other tensors the initial broadcast sends, before it sends them.

    Every rank gets every rank's list, so all raise the same :class:`ConfigError` together
    (naming the first difference of the lowest differing rank) instead of one aborting inside
    the broadcast and the others waiting for it.
    """
    trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    others: list[tuple[str, torch.Tensor]] = [
        (n, p) for n, p in module.named_parameters() if not p.requires_grad
    ]
    if broadcast_buffers:
        others += [(f"buffer {n}", b) for n, b in module.named_buffers()]
    mine = (_signature(trainable), _signature(others))
    first = next(module.parameters(), None)  # NCCL exchanges device tensors
    every = comm.allgather_objects(
        mine,
        group=group,
        what="parameter check across ranks",
        timeout_s=timeout_s,
        device=None if first is None else first.device,
    )
    for rank, theirs in enumerate(every[1:], start=1):
        for what, ref, got in zip(_KINDS, every[0], theirs, strict=True):
            problem = _first_difference(what, ref, got, rank)
            if problem:
                raise ConfigError(f"DataParallel: {problem}; every rank must wrap the same model")


_KINDS = (("trainable parameters", "trainable parameter #"), ("frozen parameters and buffers", "#"))


def _first_difference(
    what: tuple[str, str], ref: Signature, got: Signature, rank: int
) -> str | None:
    """Where rank ``rank``'s list ``got`` first differs from rank 0's ``ref``, in words."""
    for k, ((n0, s0, d0), (n1, s1, d1)) in enumerate(zip(ref, got, strict=False)):
        if (n0, s0, d0) != (n1, s1, d1):
            return (
                f"{what[1]}{k} is {n1!r} of shape {list(s1)} and dtype {d1} on rank {rank} "
                f"but {n0!r} of shape {list(s0)} and dtype {d0} on rank 0"
            )
    if len(ref) != len(got):
        longer, extra = (ref, 0) if len(ref) > len(got) else (got, rank)
        first = longer[min(len(ref), len(got))][0]
        return (
            f"rank {rank} has {len(got)} {what[0]} and rank 0 has {len(ref)} (the first "
            f"extra one, on rank {extra}: {first!r})"
        )
    return None


def _resolve_collective(allreduce: str | Collective, group: comm.Group, timeout_s: float) -> Any:
    """A registered algorithm's name (:data:`syncline.comm.ALLREDUCE`) built over ``group``,
    or a ``Collective`` the caller built (e.g. a hierarchical one from a topology)."""
    if isinstance(allreduce, str):
        return build_allreduce(allreduce, group, timeout_s=timeout_s)
    return allreduce
