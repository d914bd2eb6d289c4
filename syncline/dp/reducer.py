"""The backward side of the engine: ready-hooks, bucket launches, the end-of-backward flush.

A hook per parameter only marks it ready; when every parameter of the next bucket is ready,
that bucket starts (:class:`~syncline.dp.launches.BucketLaunches`, the launch path a
pipeline stage's REDUCE shares: its fresh gradients are moved into the flat buffer in one
batched copy and the compressor starts an asynchronous collective on it). An autograd
callback queued by the first hook of a backward flushes the remaining buckets, waits for what
is still in flight and does the once-per-step bookkeeping (unused parameters, the first step's
re-layout, bucket tuning). Buckets always launch in order, so every rank issues the same
collectives in the same order whatever order its gradients arrive in.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from syncline import comm
from syncline.comm.collectives import Collective, Pending, host_list
from syncline.comm.device import Stopwatch, comm_device
from syncline.dp.autotune import BucketTuning
from syncline.dp.buckets import BucketPlan
from syncline.dp.compression import Compressor, Layout, NoCompression
from syncline.dp.config import DataParallelConfig
from syncline.dp.guard import StepGuard
from syncline.dp.launches import BucketLaunches
from syncline.dp.layout import GradBuffer
from syncline.dp.precision import unscale_and_flag
from syncline.dp.steps import StepState, StepStats

__all__ = ["Reducer", "remove_handles"]


class Reducer:
    """Averages the gradients of ``buffer``'s parameters over the ranks during backward.

    Args:
        names: the dense parameters' names, for error messages.
        buffer: the flat buffers and their buckets.
        config: the engine's settings.
        compressor: reduces every bucket from the second synchronised step on (the first
            runs lossless, as its buckets may still be re-laid).
        collective: the collective the compressor and the bookkeeping talk through.
        group: the process group (for the broadcast of the observed order, and the sparse
            gradients' collectives).
        tuning: the bucket tuning, told each synchronised backward's time while pending.
        sparse: the names and tensors of the parameters with sparse gradients (reduced
            one by one at the end of backward, outside the buffer).
        guard: checks each bucket as it leaves and settles the step's verdict from the
            buffer's tail once the reduction is done (:mod:`syncline.dp.guard`).
    """

    def __init__(
        self,
        *,
        names: list[str],
        buffer: GradBuffer,
        config: DataParallelConfig,
        compressor: Compressor,
        collective: Collective,
        group: comm.Group,
        tuning: BucketTuning,
        sparse: list[tuple[str, torch.Tensor]] = [],  # noqa: B006 (never mutated)
        guard: StepGuard | None = None,
    ) -> None:
        self.guard = guard
        if guard is not None:
            guard.attach(buffer.device, names)
        self.names = names
        self.buf = buffer
        self.st = StepState(len(buffer.params), len(sparse))
        self.config = config
        self.compressor = compressor
        self.dense = NoCompression()
        self.collective = collective
        # a collective whose work runs in phases (hierarchical), or a compressor whose second
        # collective waits on its first (CSC, PowerSGD over a lane), advances them when
        # polled; every gradient hook polls, so later phases overlap the rest of backward
        polls = [getattr(x, "poll", None) for x in (collective, compressor)]
        self._polls: list[Callable[[], None]] = [f for f in polls if f is not None]
        self.group = group
        self.tuning = tuning
        self.sparse_names = [n for n, _ in sparse]
        #: this backward's buckets (begun at its first hook); ``sync_all`` has its own
        self.launches = BucketLaunches(buffer, collective)
        self._sync_launches = BucketLaunches(buffer, collective)
        self._sparse_pending: list[Pending] = []
        # a compressor that owns the momentum gets the lossless first step's local gradient
        # (its copy per bucket, taken before the reduction averages it in place)
        self._absorbs = callable(getattr(compressor, "absorb", None))
        self._first_local: dict[int, torch.Tensor] | None = None
        # fp16 beside an error-feedback compressor: buckets are unscaled before they reach
        # it, their non-finite values zeroed and flagged (see DataParallel.unscale_in_reduce)
        self._grad_scale = 1.0
        self.overflow: torch.Tensor | None = None
        self.sparse_params = [p for _, p in sparse]
        self.world_size = comm.group_size(group)
        self.hooks: list[Any] = []
        # where this rank's own bookkeeping tensors (the unused-parameter count, the bucket
        # order) go through torch.distributed: the group's backend decides (NCCL: CUDA only)
        self.comm_device = comm_device(comm.backend_name(group), buffer.device)
        self._backward_watch = Stopwatch(buffer.device)

    @property
    def last_stats(self) -> StepStats:
        """What the last synchronised backward communicated."""
        return self.st.last_stats

    @property
    def deferred(self) -> bool:
        """Whether a backward ended with this reduction still waiting for parameters."""
        return self.st.deferred

    @property
    def steps_synced(self) -> int:
        """Synchronised backwards so far (the compressor's step; restored from checkpoints)."""
        return self.st.steps_synced

    def restore_steps(self, steps_synced: int) -> None:
        """Carry on from a checkpoint taken after ``steps_synced`` synchronised backwards."""
        self.st.steps_synced = steps_synced

    def begin_forward(self, *, sync: bool, collective: Collective | None = None) -> None:
        """A training forward starts; ``sync``: whether its backward reduces (not ``no_sync``);
        ``collective``: what its buckets go through instead of the engine's, and whose world
        size they are divided by (``join(divide_by_initial_world_size=False)``: the ranks
        still training, :mod:`syncline.dp.join`)."""
        self.st.sync_this_backward = sync
        self.launches.collective = self.collective if collective is None else collective

    def watch_outputs(self, out: Any) -> None:
        """Hook every tensor of a training forward's ``out`` that backward can pass through
        (see [Note: end of backward])."""
        leaves = [out] if isinstance(out, torch.Tensor) else tree_leaves(out)
        for t in leaves:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self.on_output_grad)
                self.st.outputs_pending += 1

    def install_hooks(self) -> None:
        """Attach the ready-hooks to the parameters. Idempotent."""
        if not self.hooks:  # the same list object always: the engine's finalizer holds it
            self.hooks.extend(
                # a partial, not a closure: one Python frame less on a path taken per
                # parameter per step
                p.register_post_accumulate_grad_hook(functools.partial(self.on_grad_ready, i))
                for i, p in enumerate(self.buf.params)
            )
            self.hooks.extend(
                p.register_post_accumulate_grad_hook(functools.partial(self.on_sparse_ready, j))
                for j, p in enumerate(self.sparse_params)
            )

    def remove_hooks(self) -> None:
        """Detach the ready-hooks from the parameters."""
        for h in self.hooks:
            h.remove()
        self.hooks.clear()

    def reset(self) -> None:
        """Start the next backward: nothing ready, nothing launched, nothing in flight."""
        st = self.st
        st.ready = [False] * len(self.buf.params)
        st.sparse_ready = [False] * len(self.sparse_params)
        st.any_ready = False
        self.launches.clear()
        self._sparse_pending = []
        st.in_backward = False
        st.order_seen = []
        st.outputs_pending = 0
        st.deferred = False

    # [Note: end of backward] The flush runs as an autograd callback, queued on the graph
    # task of the backward that runs it. The hooks on the wrapper's outputs queue it: they fire
    # in the user's (outer) backward before any parameter's gradient, so under re-entrant
    # checkpointing, whose recomputed layers run their own nested backward inside the outer
    # one, the flush still comes once, at the end of the outer backward (queued from a
    # parameter's hook, it came when the nested backward ended, before the other gradients).
    # A parameter's hook queues it only when no output hook did (the loss did not come from
    # the wrapper's outputs). A backward that reaches no parameter (``autograd.grad`` with
    # respect to inputs) leaves everything as it was. Without find_unused_parameters, a
    # backward that ends with parameters still waiting while some output has not been
    # backpropagated yet leaves the reduction open for the next backward (one forward, one
    # backward per output: DDP finishes once every parameter is ready, however many backwards
    # that takes); the next forward refuses to start over an open one (DDP's "Expected to
    # have finished reduction in the prior iteration").
    def on_output_grad(self, grad: torch.Tensor) -> None:
        """The hook on each of the wrapper's outputs: a backward passes through it."""
        del grad
        st = self.st
        st.outputs_pending = max(0, st.outputs_pending - 1)
        if st.sync_this_backward and not st.in_backward:
            self._begin_backward()

    def _begin_backward(self) -> None:
        st = self.st
        st.in_backward = True
        if not self.launches.started:  # (a reduction left open by an earlier backward goes on)
            self.launches.begin(st.steps_synced, self.compressor_at(st.steps_synced))
            self._first_local = {} if st.steps_synced == 0 and self._absorbs else None
            needed = self._grad_scale != 1.0 or self._first_local is not None
            if self.guard is not None:
                self.guard.begin()
                needed = True
            self.launches.prepare = self._prepare if needed else None
        # timed only while the bucket tuning measures (on CUDA: events, read at the end)
        st.backward_watch = self._backward_watch.start() if self.tuning.pending else None
        torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)

    def on_grad_ready(self, i: int, _param: torch.Tensor) -> None:
        """The hook of parameter ``i``: mark it ready; launch the buckets this completes."""
        # The hot path, once per parameter per backward: bookkeeping only. The copy into the
        # buffer is batched per bucket in launch_ready_buckets (one foreach call in C++
        # instead of a Python-dispatched op per parameter: measured ~250 -> ~100 us per GPT
        # step on CPU).
        st = self.st
        st.used[i] = True
        if not st.sync_this_backward:
            return
        if not st.in_backward:
            self._begin_backward()
        if st.ready[i]:
            self._twice(self.names[i])
        st.ready[i] = True
        st.any_ready = True
        if st.steps_synced == 0 and self.config.rebuild_buckets:
            st.order_seen.append(i)  # only the first step's order is ever used
        for poll in self._polls:
            poll()
        self.launches.final(i)

    def on_sparse_ready(self, j: int, _param: torch.Tensor) -> None:
        """The hook of sparse-gradient parameter ``j``: mark it ready (reduced at the end)."""
        st = self.st
        st.sparse_used[j] = True
        if not st.sync_this_backward:
            return
        if not st.in_backward:
            self._begin_backward()
        if st.sparse_ready[j]:
            self._twice(self.sparse_names[j])
        st.sparse_ready[j] = True
        st.any_ready = True

    @staticmethod
    def _twice(name: str) -> None:
        raise RuntimeError(
            f"DataParallel: parameter {name!r} got its gradient twice in one backward "
            "(a layer checkpointed twice with re-entrant checkpointing?); DDP refuses this "
            "too ('Expected to mark a variable ready only once'): use non-reentrant "
            "checkpointing (use_reentrant=False)"
        )

    def compressor_at(self, step: int) -> Compressor:
        """What reduces the buckets of synchronised step ``step``: the first runs lossless (its
        buckets may still be re-laid, and a compressor keeps its state per bucket)."""
        return self.compressor if step > 0 else self.dense

    def unscale_in_reduce(self, scale: float) -> None:
        """From the next bucket on, divide each bucket by ``scale`` before the compressor
        takes it (``1``: off); clears the overflow flag."""
        self._grad_scale = 1.0 / scale
        self.overflow = None

    def _prepare(self, step: int, k: int, bucket: torch.Tensor) -> None:
        """Before bucket ``k`` goes out: divide it by the loss scale (an inf or NaN is zeroed
        and noted in ``overflow``, :func:`syncline.dp.precision.unscale_and_flag`); in the
        lossless first step, keep this rank's copy for the compressor (:meth:`_absorb`)."""
        del step
        if self._grad_scale != 1.0:
            self.overflow = unscale_and_flag(bucket, self._grad_scale, self.overflow)
        if self._first_local is not None:
            self._first_local[k] = bucket.clone()
        if self.guard is not None:  # checked before the allreduce overwrites it
            self.guard.observe(self.buf.members[k][1], self.buf.plan.buckets[k].params)
            if k == len(self.buf.plan.buckets) - 1:  # the last bucket carries the verdict
                self.guard.fill_tail(self.buf.tail_view())

    def in_flight(self) -> list[Pending]:
        """The collectives of the current reduction: its buckets', then its sparse ones."""
        return self.launches.pending + self._sparse_pending

    def abandon(self) -> None:
        """Wait for whatever the current reduction has in flight, then forget it."""
        for pending in self.in_flight():
            pending.wait()
        self.reset()

    def finish_backward(self) -> None:
        """End of a synchronised backward: flush, wait, account, re-lay or re-cut if due."""
        st, buf = self.st, self.buf
        if st.any_ready and self._stays_open():
            st.in_backward = False  # the next backward queues its own callback
            st.deferred = True
            return
        try:
            if not st.any_ready:  # no parameter in this backward: nothing to reduce
                return
            kept = self._flush_unready()
            step_comm = self.launches.collective  # the engine's, or join's (fewer ranks)
            world = self.world_size if step_comm is self.collective else step_comm.world_size
            kept_sparse = self._reduce_sparse(self._sparse_pending, world)
            exposed = Stopwatch(buf.device).start()
            pending = self.in_flight()
            for p in pending:
                p.wait()
            exposed.stop()
            if self.guard is not None:
                self.guard.settle(self.buf.tail_view())
            if self.config.find_unused_parameters:
                self._restore_globally_unused(kept, kept_sparse)
            st.last_stats = StepStats(
                step=st.steps_synced,
                collectives=len(pending),
                wire_bytes=sum(p.wire_bytes for p in pending),
                dense_bytes=buf.nbytes,
                watch=exposed,
            )
            plan, layouts = self.buf.plan, self.buf.layouts  # the first step's cut
            if st.steps_synced == 0 and self.config.rebuild_buckets:
                self.rebuild_from_observed_order()
            if self._first_local is not None:
                self._absorb(self._first_local, plan, layouts)
                self._first_local = None
            if self.tuning.pending and st.backward_watch is not None:
                backward_s = st.backward_watch.stop().elapsed_s()  # tuning steps only
                self.tuning.observe(backward_s, st.syncs_done, st.steps_synced)
            st.steps_synced += 1
            st.syncs_done += 1
            st.used = [False] * len(buf.params)
            st.sparse_used = [False] * len(self.sparse_params)
            buf.stand_in = [False] * len(buf.params)
        finally:
            self.reset()

    def _absorb(
        self, local: dict[int, torch.Tensor], plan: BucketPlan, layouts: list[Layout]
    ) -> None:
        """Hand the lossless first step's local gradients to the compressor that owns the
        momentum, bucket by bucket as it will see them (the buffer may have been re-laid
        since): its momentum receives every step's gradient, this one too."""
        grads: dict[int, torch.Tensor] = {}
        for k, flat in local.items():
            for i, (offset, shape) in zip(plan.buckets[k].params, layouts[k], strict=True):
                grads[i] = flat[offset : offset + math.prod(shape)]
        absorb = self.compressor.absorb  # type: ignore[attr-defined]  # checked: _absorbs
        for b in self.buf.plan.buckets:
            absorb(b.index, torch.cat([grads[i] for i in b.params]))

    def _stays_open(self) -> bool:
        """Whether this reduction waits for a further backward (see [Note: end of backward])."""
        st = self.st
        if self.config.find_unused_parameters or st.outputs_pending == 0:
            return False
        return not (all(st.ready) and all(st.sparse_ready))

    def unready_names(self) -> list[str]:
        """The parameters the current reduction still waits for."""
        st = self.st
        names = [n for n, r in zip(self.names, st.ready, strict=True) if not r]
        return names + [n for n, r in zip(self.sparse_names, st.sparse_ready, strict=True) if not r]

    def _flush_unready(self) -> dict[int, torch.Tensor]:
        """Mark the parameters without a gradient ready (zeros, or the gradient they hold).

        Returns:
            With ``find_unused_parameters`` and ``gradient_as_bucket_view=False``: the local
            value of each such parameter's existing gradient, which DDP leaves untouched if no
            rank used the parameter (:meth:`_restore_globally_unused`).
        """
        st, buf = self.st, self.buf
        unready = [i for i, r in enumerate(st.ready) if not r]
        if not self.config.find_unused_parameters:
            names = self.unready_names()
            if names:
                raise RuntimeError(
                    f"DataParallel: {len(names)} parameter(s) got no gradient in step "
                    f"{st.steps_synced}: {names[:8]}; pass find_unused_parameters=True, or "
                    "make every parameter take part in the loss"
                )
        kept: dict[int, torch.Tensor] = {}
        for i in unready:
            p, view = buf.params[i], buf.views[i]
            buf.adopt(i, p, view, p.grad)  # an existing gradient is reduced, as DDP does
            if buf.keep_spent and not buf.stand_in[i]:
                kept[i] = view.clone()
            st.ready[i] = True
            self.launches.final(i)
        return kept

    def _reduce_sparse(self, pending: list[Pending], world: int) -> dict[int, torch.Tensor | None]:
        """Start the sum of every sparse gradient, after the buckets, in parameter order.

        As DDP: each sparse gradient is its own collective (gloo allgathers indices and
        values), divided by ``world`` first; the result, still sparse, becomes
        ``param.grad``. A parameter this rank did not use sends an empty gradient. Each
        collective is appended to ``pending``.

        Returns:
            With ``find_unused_parameters``: per such locally unused parameter, the gradient
            it had (``None`` or a copy), restored if no rank used it.
        """
        st = self.st
        kept: dict[int, torch.Tensor | None] = {}
        for j, p in enumerate(self.sparse_params):
            g = p.grad
            if not st.sparse_ready[j] and self.config.find_unused_parameters:
                kept[j] = None if g is None else g.clone()
            if g is None:
                g = torch.sparse_coo_tensor(
                    torch.empty((1, 0), dtype=torch.long, device=p.device),
                    p.new_empty((0, *p.shape[1:])),
                    p.shape,
                )
            elif not g.is_sparse:
                raise RuntimeError(
                    f"DataParallel: parameter {self.sparse_names[j]!r} belongs to a module "
                    "with sparse=True but has a dense gradient; set the module's sparse flag "
                    "before wrapping"
                )
            if world > 1:
                g.div_(world)
            p.grad = g
            what = f"sparse gradient {self.sparse_names[j]!r} at step {st.steps_synced}"
            pending.append(
                comm.allreduce_sparse(
                    g, group=self.group, what=what, timeout_s=self.config.timeout_s
                )
            )
        return kept

    def _restore_globally_unused(
        self, kept: dict[int, torch.Tensor], kept_sparse: dict[int, torch.Tensor | None]
    ) -> None:
        """A parameter no rank used gets back the gradient it had before this backward.

        As DDP's reducer (``copy_bucket_to_grad`` skips globally unused parameters), and as
        local training: ``None`` stays ``None`` (optimizers skip it), and an existing gradient
        (left from an earlier step, or set by the user) keeps its local value. One exception:
        a compressor with error feedback (CSC, TopK, PowerSGD) may send now what it kept from
        a step that did use the parameter; that gradient is the parameter's, so it stays.
        "Unused" means
        by no backward since the last synchronised one, ``no_sync`` ones included. With
        ``gradient_as_bucket_view=True`` DDP's gradient *is* the reduced bucket, so there the
        rank average stays, as in DDP.
        """
        st, buf = self.st, self.buf
        # A host decision by nature (which parameters get None back): one read of the counts
        # per step, and at most one more for the error-feedback check below.
        mine = [int(u) for u in st.used + st.sparse_used]
        used = torch.tensor(mine, dtype=torch.int32, device=self.comm_device)
        self.collective.allreduce(used, f"unused-parameter count at step {st.steps_synced}").wait()
        counts = host_list(used, meta=mine)
        unused = [i for i, count in enumerate(counts[: len(buf.params)]) if count == 0]
        delayed = self._sent_by_error_feedback([i for i in unused if buf.stand_in[i]])
        for i in unused:
            if buf.stand_in[i]:
                if i in delayed:
                    # error feedback sent what it had kept for this parameter from a step
                    # that used it: a delayed gradient, applied, not dropped
                    continue
                buf.params[i].grad = None
            elif i in kept:
                buf.views[i].copy_(kept[i])
        for j, count in enumerate(counts[len(buf.params) :]):
            if count == 0 and j in kept_sparse:
                self.sparse_params[j].grad = kept_sparse[j]

    def _sent_by_error_feedback(self, stand_ins: list[int]) -> set[int]:
        """Which of these parameters (no rank used them; their gradient was a zeroed stand-in)
        received something nonzero anyway: a compressor with error feedback sent what it
        had kept for them. One host read for all of them, none for a stateless compressor."""
        if self.compressor.stateless or not stand_ins:
            return set()
        views = self.buf.views
        flags = torch.stack([views[i].any() for i in stand_ins])
        nonzero = host_list(flags, meta=[False] * len(stand_ins))
        return {i for i, sent in zip(stand_ins, nonzero, strict=True) if sent}

    def rebuild_from_observed_order(self) -> None:
        """Re-lay the buffer in the order the first step's gradients became ready (rank 0's).

        Once, at the end of the first synchronised backward: the order is broadcast on the
        communication device and read back on the host (the buffer is laid out by it).
        """
        seen = list(dict.fromkeys(self.st.order_seen))
        seen_set = set(seen)
        rest = [i for i in self.buf.plan.order if i not in seen_set]
        mine = seen + rest
        order = torch.tensor(mine, dtype=torch.int64, device=self.comm_device)
        comm.broadcast_tensors([order], group=self.group, what="bucket order")
        new_order = [int(i) for i in host_list(order, meta=mine)]
        if tuple(new_order) != self.buf.plan.order:
            self.buf.install(new_order, keep_grads=True)

    def sync_all(self) -> StepStats:
        """Average the whole buffer (and any sparse gradients) now, lossless, outside any
        backward."""
        buf, step = self.buf, self.st.steps_synced
        buf.attach_grads()
        launches = self._sync_launches
        launches.begin(step, self.dense)
        launches.start_rest()
        pending = launches.pending
        launches.clear()
        self.st.sparse_ready = [True] * len(self.sparse_params)
        try:
            self._reduce_sparse(pending, self.world_size)
        finally:
            self.st.sparse_ready = [False] * len(self.sparse_params)
        watch = Stopwatch(buf.device).start()
        for p in pending:
            p.wait()
        return StepStats(
            step=step,
            collectives=len(pending),
            wire_bytes=sum(p.wire_bytes for p in pending),
            dense_bytes=buf.nbytes,
            watch=watch.stop(),
        )


def remove_handles(handles: list[Any]) -> None:
    """Remove hook handles (the finalizer of a collected wrapper; must not reference it)."""
    for h in handles:
        h.remove()
    handles.clear()
