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
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import torch
from torch import nn

from syncline import comm
from syncline.comm import join as comm_join
from syncline.comm.collectives import Collective
from syncline.comm.device import comm_device
from syncline.comm.registry import resolve_allreduce
from syncline.dp import join as _join
from syncline.dp.autotune import BucketTuning
from syncline.dp.buckets import BucketPlan
from syncline.dp.compression import Compressor, NoCompression
from syncline.dp.config import DataParallelConfig
from syncline.dp.ddp_surface import (
    buffer_syncs,
    ddp_attribute_names,
    own_attribute,
    pickled_state,
    refusal,
    refuse_unsupported,
    take_over,
)
from syncline.dp.guard import StepGuard, check_guardable
from syncline.dp.layout import GradBuffer, trainable_parameters
from syncline.dp.periodic import Synchronizer, SyncStrategy
from syncline.dp.placement import moved_to, placement
from syncline.dp.reducer import Reducer, remove_handles
from syncline.dp.steps import StepStats
from syncline.dp.tuning import autotune_choice
from syncline.dp.verify import check_same_on_all_ranks
from syncline.errors import ConfigError

__all__ = ["DataParallel", "StepStats"]

_D = DataParallelConfig()  # the defaults of syncline's own settings, written once there


class DataParallel(nn.Module, comm_join.Joinable):
    """Data parallelism over a process group; a training loop written for DDP works unchanged.

    Args:
        module: the model; every rank's parameters must match rank 0's in names, shapes and
            dtypes (checked here, before anything is sent, as DDP does); then its parameters
            and buffers are broadcast from rank 0, so all replicas start identical. A
            previous DataParallel of the same module stops working (its hooks are removed).
            Names listed in ``module._ddp_params_and_buffers_to_ignore`` (DDP's
            ``_set_params_and_buffers_to_ignore_for_model``) are neither sent nor averaged.
            Parameters may mix dtypes (one flat buffer per dtype). Those of an
            ``nn.Embedding``/``nn.EmbeddingBag`` with ``sparse=True`` keep sparse gradients,
            each reduced by its own sparse allreduce at the end of backward, uncompressed.
        device_ids, output_device: DDP 2.13's rules: for a module on one GPU,
            ``device_ids=[its device]`` (an index or a ``torch.device``) makes every forward
            first move the tensors in its arguments there (nested in tuples, lists, dicts and
            namedtuples; other objects, dataclasses included, are passed as they are, as in
            DDP); ``None`` leaves inputs where they are. ``output_device`` (default
            ``device_ids[0]``) is recorded, as DDP records it: outputs stay where the module
            puts them. For a CPU module both must be left unset. Refused up front: more
            than one device id, a device the module is not on, and a module spread over
            several devices (one flat buffer per dtype lives on one device).
        dim, check_reduction, static_graph, batched_grad_copy: accepted for DDP
            compatibility (no effect).
        init_sync: as in DDP: ``False`` skips the check across ranks and the initial
            broadcast (the ranks keep their own values).
        gradient_as_bucket_view: gradients are always views into the flat buffer; this
            chooses the memory, as in DDP. ``False`` (DDP's default): autograd's own gradient
            tensors, once copied into the buffer, are kept until the next forward (one extra
            gradient-sized set, like DDP's gradients beside its buckets; faster, see
            :meth:`forward`). ``True``: they are freed once their bucket is copied (DDP's
            lean mode).
        forward_sync_buffers, broadcast_buffers: as in DDP 2.13: rank 0's current buffers
            are sent to all before a forward that follows a synchronised training forward
            (``forward_sync_buffers=True``, the default); ``broadcast_buffers`` is its older
            name, whose ``False`` also leaves the buffers out of the initial broadcast.
        process_group, bucket_cap_mb, find_unused_parameters: as in DDP.
        delay_all_reduce_named_params, param_to_hook_all_reduce, mixed_precision,
            device_mesh, skip_all_reduce_unused_params, bucket_cap_mb_list: DDP options
            without an equivalent here; any value but the default is refused.
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
        guard: a :class:`~syncline.dp.guard.StepGuard`: NaN/Inf and loss spikes found on
            the device and agreed inside the bucket allreduce (see that module).
        sync: how often the replicas agree (:data:`syncline.dp.syncs.SYNCS`): every step
            (default), ``"localsgd:PERIOD[:start=N]"``, ``"diloco:H[...]"`` or a strategy of
            :mod:`syncline.dp.periodic`; a periodic one needs :meth:`attach`.

    Raises:
        ConfigError: on invalid sizes, no trainable parameters, parameters (or broadcast
            buffers) that differ across ranks (on every rank), an unsupported DDP option,
            ``device_ids``/``output_device`` that do not fit the module (see above), a module
            on the CPU under NCCL, or ``autotune_buckets=True`` with a compressor that keeps
            per-bucket state.

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
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
        process_group: comm.Group = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params: Any = None,
        param_to_hook_all_reduce: Any = None,
        mixed_precision: Any = None,
        device_mesh: Any = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: list[int] | None = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
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
        guard: StepGuard | None = None,
        sync: str | SyncStrategy = "every-step",
    ) -> None:
        settings = {k: v for k, v in locals().items() if k not in ("self", "module", "__class__")}
        super().__init__()
        self._settings = settings  # what a pickled wrapper is built again with
        del dim, check_reduction, static_graph, batched_grad_copy
        refuse_unsupported(
            delay_all_reduce_named_params=delay_all_reduce_named_params,
            param_to_hook_all_reduce=param_to_hook_all_reduce,
            mixed_precision=mixed_precision,
            device_mesh=device_mesh,
            bucket_cap_mb_list=bucket_cap_mb_list,
            skip_all_reduce_unused_params=skip_all_reduce_unused_params or None,
        )
        self._ignored = frozenset(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        self.device_ids, self.output_device, self._input_device = placement(
            module, self._ignored, device_ids, output_device, comm.backend_name(process_group)
        )
        sync_buffers, init_sync_buffers = buffer_syncs(forward_sync_buffers, broadcast_buffers)
        self._compressor: Compressor = compression or NoCompression()
        autotune_buckets = autotune_choice(
            self._compressor,
            autotune_buckets,
            bucket_cap_mb is None
            and first_bucket_cap_mb is None
            and getattr(sync, "name", sync) == "every-step",
        )
        self.config = DataParallelConfig(
            bucket_cap_mb=_D.bucket_cap_mb if bucket_cap_mb is None else bucket_cap_mb,
            first_bucket_cap_mb=first_bucket_cap_mb,
            broadcast_buffers=sync_buffers,
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
        self._comm = resolve_allreduce(allreduce, process_group, timeout_s=timeout_s)
        # the lane (see FlatAllreduce.lane) is a process group: made at the first training
        # forward, every rank's, not here
        self._lane_due = getattr(self._compressor, "wants_lane", False) and isinstance(
            self._comm, comm.FlatAllreduce
        )
        if init_sync:  # first, so that a rank without trainable parameters fails on every rank
            check_same_on_all_ranks(
                module, self._ignored, init_sync_buffers, process_group, timeout_s
            )
        names, params, sparse = trainable_parameters(module, self._ignored)
        dense_and_sparse = params + [p for _, p in sparse]
        self._sync = Synchronizer(sync, dense_and_sparse, self._compressor, self._comm)
        if guard is not None:  # before the buffer is laid out with the guard's tail
            check_guardable(self._compressor, params, sparse, periodic=self._sync.periodic)

        if init_sync:  # the same starting point on every rank (the one side effect we must have)
            comm.broadcast_tensors(
                [p.data for n, p in module.named_parameters() if n not in self._ignored]
                + (self._buffers_to_sync() if init_sync_buffers else []),
                group=process_group,
                what="initial parameter broadcast",
            )
        caps = (self.config.first_cap_bytes, self.config.cap_bytes)
        self._buf = GradBuffer(
            params,
            caps,
            keep_spent=not gradient_as_bucket_view,
            device=sparse[0][1].device if sparse else None,
            tail=0 if guard is None else StepGuard.TAIL,
        )
        self.guard = guard
        self._buf.install(list(reversed(range(len(params)))))  # backward runs roughly in reverse
        comm_dev = comm_device(comm.backend_name(process_group), self._buf.device)
        self._tuning = BucketTuning(self.config, self._buf, self._comm, device=comm_dev)
        self._reducer = Reducer(
            names=names,
            buffer=self._buf,
            config=self.config,
            compressor=self._compressor,
            collective=self._comm,
            group=process_group,
            tuning=self._tuning,
            sparse=sparse,
            guard=guard,
        )
        self._superseded = False
        take_over(module, self)
        self.install_hooks()
        # the hooks hold the reducer, never this wrapper; once the wrapper is collected they
        # are removed (the finalizer holds only their handle list, which stays the same list)
        self._finalizer = weakref.finalize(self, remove_handles, self._reducer.hooks)
        self._world_size = comm.group_size(process_group)
        comm_join.Joinable.__init__(self)  # not in a join context yet
        self._join_state = _join.JoinState()
        self._sync_enabled = True
        self._sync_buffers_next = True  # DDP's require_forward_param_sync
        self._buffer_list: list[torch.Tensor] = []
        self._buffer_bcast: comm.PackedBroadcast | None = None
        self._reducer.reset()

    @property
    def last_stats(self) -> StepStats:
        """What the last synchronised backward communicated."""
        return self._reducer.last_stats

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
        if self._reducer.deferred:
            self._refuse_open_reduction()
        self._buf.spent.clear()
        if self._input_device is not None:  # DDP's device_ids[0]
            args, kwargs = moved_to((args, kwargs), self._input_device)
        joining = self._join_config.enable  # in a join context (see syncline.dp.join)
        if joining:
            _join.notify(self)
        if self._sync_buffers_next and self.config.broadcast_buffers and self._world_size > 1:
            self._sync_buffers()
        training = torch.is_grad_enabled() and self._sync_enabled
        self._sync_buffers_next = training
        step_comm = _join.announce(self, training) if joining else None
        if not torch.is_grad_enabled():
            return self.module(*args, **kwargs)
        if self._lane_due:
            self._lane_due = False
            comm.open_lane(self._comm)
        reduce = self._sync.begin_forward(self._sync_enabled, training=True)
        self._reducer.begin_forward(sync=reduce, collective=step_comm)
        self._buf.attach_grads(lazy=True)
        out = self.module(*args, **kwargs)
        if training:
            self._reducer.watch_outputs(out)
        return out

    def _refuse_open_reduction(self) -> NoReturn:
        names = self._reducer.unready_names()
        self._reducer.abandon()  # nothing left in flight behind the error
        raise RuntimeError(
            f"DataParallel: the previous step's gradient reduction did not finish: "
            f"{len(names)} parameter(s) got no gradient in any backward since the last "
            f"forward: {names[:8]}; pass find_unused_parameters=True, or make every "
            "parameter take part in the loss (DDP: 'Expected to have finished reduction in "
            "the prior iteration')"
        )

    def _sync_buffers(self, candidate: bool = True) -> None:
        """Give every rank rank 0's current buffers, before this forward, as DDP does (in a
        join context: the largest rank's still training, ``candidate`` says if this is one).

        The buffers are looked up again each time (a buffer reassigned since, ``m.b = m.b +
        1``, is sent too); while they stay the same tensors, the packed message and its
        per-buffer views are reused. Written without bumping the buffers' version counters
        (as DDP): a buffer saved for backward by an earlier forward whose backward has not
        run yet (two forwards, one backward, with BatchNorm) stays usable.
        """
        buffers = self._buffers_to_sync()
        if not buffers:
            return
        src = _join.buffer_source(self, candidate) if self._join_config.enable else 0
        same = len(buffers) == len(self._buffer_list) and all(
            a is b for a, b in zip(buffers, self._buffer_list, strict=True)
        )
        if self._buffer_bcast is None or not same:
            self._buffer_list = buffers  # strong references: ids of the old ones not reused
            self._buffer_bcast = comm.PackedBroadcast(
                buffers, group=self.process_group, timeout_s=self.config.timeout_s
            )
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tuple(buffers)):
            what = f"buffer broadcast before step {self._reducer.steps_synced}"
            self._buffer_bcast.start(what, src=src).wait()

    def _buffers_to_sync(self) -> list[torch.Tensor]:
        return [b for n, b in self.module.named_buffers() if n not in self._ignored]

    @property
    def require_backward_grad_sync(self) -> bool:
        """DDP's flag scripts set instead of :meth:`no_sync`: False, no reduction."""
        return bool(self._sync_enabled)

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._sync_enabled = bool(value)

    @property
    def require_forward_param_sync(self) -> bool:
        """DDP's flag: whether the next forward broadcasts rank 0's buffers first."""
        return bool(self._sync_buffers_next)

    @require_forward_param_sync.setter
    def require_forward_param_sync(self, value: bool) -> None:
        self._sync_buffers_next = bool(value)

    def __setattr__(self, name: str, value: Any) -> None:
        # a DDP setting DataParallel does not implement must not land unread in __dict__
        if name in ddp_attribute_names() and not own_attribute(self, name):
            raise AttributeError(refusal(name))
        super().__setattr__(name, value)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name not in ddp_attribute_names():
                raise
            raise AttributeError(refusal(name)) from None

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

    def unscale_in_reduce(self, scale: float) -> None:
        """fp16 loss scaling beside a compressor with a residual (CSC, TopK, PowerSGD): the
        next backward divides each bucket by ``scale`` *before* the compressor sees it, and
        zeroes (and flags, :meth:`overflowed_in_reduce`) any inf or NaN. So the residual
        holds true-scale, finite values whatever the scale does, and the gradients this
        backward leaves are already unscaled. ``scale=1`` turns it off."""
        if not scale > 0:
            raise ConfigError(f"unscale_in_reduce(scale={scale!r}); valid: a scale > 0")
        self._reducer.unscale_in_reduce(scale)

    def overflowed_in_reduce(self) -> bool:
        """Whether a bucket of this rank held an inf or NaN since :meth:`unscale_in_reduce`
        (this rank alone: the verdict is the caller's to agree on). Reads the flag on the
        host (a sync on a GPU): :meth:`overflow_flag_in_reduce` leaves it on the device."""
        flag = self._reducer.overflow
        return flag is not None and bool(flag)

    def overflow_flag_in_reduce(self) -> torch.Tensor | None:
        """The flag behind :meth:`overflowed_in_reduce` (nonzero: an inf or NaN was zeroed)
        on the device, or ``None``: to fold into one verdict per step, read once."""
        return self._reducer.overflow

    # -- state --------------------------------------------------------------------------
    def compression_state_dict(self) -> dict[str, Any]:
        """The compressor's state (residuals, factors), for checkpoints."""
        return {
            "name": self._compressor.name,
            "steps_synced": self._reducer.steps_synced,
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
        self._reducer.restore_steps(int(state["steps_synced"]))
        self._compressor.load_state_dict(state["state"])

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Synchronise after each step of ``optimizer`` (``sync=``'s step count), and refuse
        it beside a compressor if momentum would be applied twice; idempotent."""
        self._sync.attach(optimizer)

    @property
    def sync(self) -> Synchronizer:
        """The ``sync=`` strategy at work: its ``state_dict()``, ``in_sync()``, bytes sent."""
        return self._sync

    def install_hooks(self) -> None:
        """Attach the ready-hooks to the parameters (done at construction; again after
        :meth:`remove_hooks`). Idempotent."""
        if self._superseded:
            self._refuse_superseded()
        self._reducer.install_hooks()

    def remove_hooks(self) -> None:
        """Detach from the module's parameters (wrapping it again does this by itself)."""
        self._reducer.remove_hooks()

    def register_comm_hook(self, state: object, hook: object) -> NoReturn:
        """DDP's communication hooks are not provided: refused, naming what to use instead."""
        del state, hook
        raise ConfigError(
            "DataParallel does not take DDP comm hooks: choose the reduction with "
            "compression= (e.g. syncline.dp.COMPRESSORS: fp16, bf16, powersgd, topk, csc) "
            "or allreduce= (e.g. a HierarchicalAllreduce)"
        )

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> comm_join.Join:
        """DDP's context for uneven inputs, with DDP's arguments: ``with model.join(): for
        batch in my_shard: ...``; a rank out of batches shadows the others' collectives
        (:mod:`syncline.dp.join`). ``Join([model, ...])`` (torch's) works too.

        Raises:
            ConfigError: the compressor keeps per-rank state (CSC, TopK, PowerSGD)."""
        joinables: list[comm_join.Joinable] = [self]
        kw = {"divide_by_initial_world_size": divide_by_initial_world_size}
        return comm_join.Join(joinables, enable, throw_on_early_termination, **kw)

    def join_hook(self, **kwargs: Any) -> comm_join.JoinHook:
        """torch's ``Joinable``: what a rank out of inputs runs (see :meth:`join`)."""
        return _join.hook(self, **kwargs)

    @property
    def join_device(self) -> torch.device:
        """torch's ``Joinable``: where the join context's own collectives run."""
        return self._reducer.comm_device

    @property
    def join_process_group(self) -> Any:
        """torch's ``Joinable``: the group (the default group itself when none was given)."""
        return comm_join.join_group(self.process_group)

    def _supersede(self) -> None:
        """A newer DataParallel of the same module took over: detach and refuse to run."""
        self.remove_hooks()
        self._superseded = True

    def _refuse_superseded(self) -> NoReturn:
        raise ConfigError(
            "DataParallel: this wrapper was superseded by a newer DataParallel of the same "
            "module (its hooks are removed); use the newer one"
        )

    def __getstate__(self) -> dict[str, Any]:
        """Pickling (and deepcopy) keep what DDP's do (:func:`~.ddp_surface.pickled_state`)."""
        return pickled_state(self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        DataParallel.__init__(self, state["module"], **state["settings"])
        self.train(state["train"])
