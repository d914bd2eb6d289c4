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
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from syncline import comm
from syncline.comm.collectives import Collective, FlatAllreduce, Pending
from syncline.config import DataParallelConfig
from syncline.dp.buckets import BucketPlan, plan_buckets
from syncline.dp.compression import BucketRef, Compressor, Layout, NoCompression
from syncline.dp.tuning import (
    BucketCandidate,
    TuningSchedule,
    bucket_candidates,
    choose,
    min_over_ranks,
    survivors,
)
from syncline.errors import ConfigError


@dataclass
class StepStats:
    """What the last synchronised backward communicated."""

    step: int = 0
    collectives: int = 0
    wire_bytes: int = 0
    dense_bytes: int = 0
    exposed_comm_s: float = 0.0


class DataParallel(nn.Module):
    """Data parallelism over a process group; a training loop written for DDP works unchanged.

    Args:
        module: the model; its parameters and buffers are broadcast from rank 0 here, as DDP
            does, so all replicas start identical.
        device_ids, output_device, dim, check_reduction, static_graph: accepted for DDP
            compatibility; on CPU the device arguments are ignored.
        gradient_as_bucket_view: gradients are always views into the flat buffer; this
            chooses the memory, as in DDP. ``False`` (DDP's default): autograd's own gradient
            tensors, once copied into the buffer, are kept until the next forward (one extra
            gradient-sized set, like DDP's gradients beside its buckets; faster, see
            :meth:`forward`). ``True``: they are freed once their bucket is copied (DDP's
            lean mode).
        broadcast_buffers, process_group, bucket_cap_mb, find_unused_parameters: as in DDP.
        first_bucket_cap_mb, rebuild_buckets, timeout_s: see :class:`DataParallelConfig`.
        compression: a :class:`~syncline.dp.compression.Compressor` (default: lossless).
        allreduce: ``"flat"`` or a :class:`~syncline.comm.Collective` (e.g. hierarchical).
        autotune_buckets: measure a few bucket plans during the first synchronised steps
            and keep the fastest (:mod:`syncline.dp.tuning`; the result is in
            :attr:`bucket_tuning`). ``None`` (default): on when neither cap is given and the
            compressor is stateless (lossless, fp16, bf16); DDP's sizes are the first
            candidate, and ~50 steps of a 3.4 MB GPT settle it. Tuning never changes the
            result: only where the buffer is cut.
        tune_steps_per_trial, tune_rounds, tune_final_rounds, tune_keep_margin,
            tune_min_bucket_mb: see :class:`DataParallelConfig`.

    Raises:
        ConfigError: on invalid sizes, no trainable parameters, mixed parameter dtypes, or
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
        rebuild_buckets: bool = True,
        timeout_s: float = 300.0,
        compression: Compressor | None = None,
        allreduce: str | Collective = "flat",
        autotune_buckets: bool | None = None,
        tune_steps_per_trial: int = 2,
        tune_rounds: int = 2,
        tune_final_rounds: int = 4,
        tune_keep_margin: float = 0.05,
        tune_min_bucket_mb: float = 0.125,
    ) -> None:
        super().__init__()
        del device_ids, output_device, dim, check_reduction, static_graph
        self._compressor: Compressor = compression or NoCompression()
        stateless = bool(getattr(self._compressor, "stateless", False))
        if autotune_buckets is None:  # tune unless the user chose the sizes
            autotune_buckets = bucket_cap_mb is None and first_bucket_cap_mb is None and stateless
        elif autotune_buckets and not stateless:
            raise ConfigError(
                f"autotune_buckets=True needs a stateless compressor (none, fp16, bf16); "
                f"{self._compressor.name!r} keeps per-bucket state, so its buckets must not "
                "change: pass bucket_cap_mb instead"
            )
        self.config = DataParallelConfig(
            bucket_cap_mb=25.0 if bucket_cap_mb is None else bucket_cap_mb,
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
        self._dense = NoCompression()
        self._caps = (self.config.first_cap_bytes, self.config.cap_bytes)

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ConfigError("DataParallel: the module has no parameter with requires_grad=True")
        dtypes = sorted({str(p.dtype) for _, p in named})
        if len(dtypes) > 1:
            raise ConfigError(f"DataParallel: trainable parameters mix dtypes {dtypes}; use one")
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]

        # Same starting point on every rank (DDP semantics; the one side effect we must have).
        comm.broadcast_tensors(
            [p.data for p in module.parameters()] + list(module.buffers()),
            group=process_group,
            what="initial parameter broadcast",
        )
        order = list(reversed(range(len(self._params))))  # backward runs roughly in reverse
        self._install_plan(order)
        self._hooks: list[Any] = []
        self.install_hooks()
        self._world_size = comm.group_size(process_group)
        self._spent: list[torch.Tensor] = []  # autograd's gradients, moved; freed at forward
        self._keep_spent = not gradient_as_bucket_view
        self._sync_enabled = True
        self._buffer_bcast: comm.PackedBroadcast | None = None
        self._st = _StepState(len(self._params))
        self._tuner: _Tuner | None = None
        self.bucket_tuning: dict[str, Any] | None = None
        self._reset_backward_state()

    @property
    def last_stats(self) -> StepStats:
        """What the last synchronised backward communicated."""
        return self._st.last_stats

    # -- layout -------------------------------------------------------------------------
    def _plan_for(self, order: list[int] | tuple[int, ...], first_cap: int, cap: int) -> BucketPlan:
        return plan_buckets(
            [p.numel() for p in self._params], order, self._params[0].element_size(), cap, first_cap
        )

    def _install_plan(self, order: list[int], keep_grads: bool = False) -> None:
        p0 = self._params[0]
        plan = self._plan_for(order, *self._caps)
        flat = torch.zeros(plan.total_numel, dtype=p0.dtype, device=p0.device)
        views = [
            flat[off : off + p.numel()].view_as(p)
            for off, p in zip(plan.offsets, self._params, strict=True)
        ]
        if keep_grads:
            for p, v in zip(self._params, views, strict=True):
                if p.grad is not None:
                    v.copy_(p.grad)
                    p.grad = v
        self._flat = flat
        self._views = views
        self._cut(plan)

    def _cut(self, plan: BucketPlan) -> None:
        """Adopt ``plan``'s buckets over the current buffer (its offsets must be the buffer's)."""
        self._plan: BucketPlan = plan
        # per bucket, its parameters and their views, so a launch gathers them in one pass
        self._members = [
            ([self._params[i] for i in b.params], [self._views[i] for i in b.params])
            for b in plan.buckets
        ]
        self._layouts: list[Layout] = [
            tuple((plan.offsets[i] - b.start, tuple(self._params[i].shape)) for i in b.params)
            for b in plan.buckets
        ]

    @property
    def bucket_plan(self) -> BucketPlan:
        """The current flat layout and buckets (pure data)."""
        return self._plan

    # -- forward ------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # Autograd's own gradient tensors, already copied into the buffer, are freed here
        # and not in the hooks: freed mid-backward, their memory went back to the allocator
        # while backward still allocated, and the model ran measurably slower (forward ~3 %
        # more CPU on the default GPT, with page faults in backward); freed now, right before
        # forward allocates, their memory is reused warm, as with DDP, whose gradients live
        # until zero_grad. The peak is DDP's too: one gradient-sized set beside the buffer.
        self._spent.clear()
        self.finish_buffer_sync()
        if not torch.is_grad_enabled():
            return self.module(*args, **kwargs)
        self._st.sync_this_backward = self._sync_enabled
        self._attach_grads(lazy=True)
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
        pending, self._st.buffer_sync = self._st.buffer_sync, None
        if pending is not None:
            pending.wait()

    def _attach_grads(self, *, lazy: bool = False) -> None:
        """Make every ``param.grad`` a view into the flat buffer (zeroed where it was None).

        ``lazy`` (before a training forward): when every gradient is None (``zero_grad(
        set_to_none=True)``), attach nothing. Autograd then hands each parameter a fresh
        gradient, which its bucket's launch copies into its view: one pass over the bytes instead
        of zeroing the buffer and adding into it (measured ~1 % of a GPT step on CPU); a
        parameter that gets no gradient is zeroed at the end of backward.
        """
        grads = [p.grad for p in self._params]
        if all(g is None for g in grads):
            if lazy:
                return
            self._flat.zero_()
            for p, v in zip(self._params, self._views, strict=True):
                p.grad = v
            return
        for p, v, g in zip(self._params, self._views, grads, strict=True):
            if g is None:
                v.zero_()
                p.grad = v
            elif g.data_ptr() != v.data_ptr():
                v.copy_(g)
                p.grad = v

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no communication) for forwards run inside."""
        old = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = old

    # -- backward -----------------------------------------------------------------------
    def _reset_backward_state(self) -> None:
        n = len(self._params)
        self._st.ready = [False] * n
        self._st.remaining = [len(b.params) for b in self._plan.buckets]
        self._st.next_bucket = 0
        self._st.pending = []
        self._st.in_backward = False
        self._st.order_seen = []

    def _make_hook(self, i: int) -> Any:
        # a partial, not a closure: one Python frame less on a path taken per parameter per step
        return functools.partial(self._on_grad_ready, i)

    def _on_grad_ready(self, i: int, _param: torch.Tensor) -> None:
        # The hot path, once per parameter per backward: bookkeeping only. The copy into the
        # buffer is batched per bucket in _launch_ready_buckets (one foreach call in C++
        # instead of a Python-dispatched op per parameter: measured ~250 -> ~100 us per GPT
        # step on CPU).
        st = self._st
        st.used[i] = True
        if not st.sync_this_backward:
            return
        if not st.in_backward:
            st.in_backward = True
            st.t_first_ready = time.perf_counter()
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        if st.ready[i]:
            raise RuntimeError(
                f"DataParallel: parameter {self._names[i]!r} got its gradient twice in one "
                "backward (re-entrant checkpointing over a shared parameter?); DDP refuses "
                "this too: use non-reentrant checkpointing"
            )
        st.ready[i] = True
        if st.steps_synced == 0 and self.config.rebuild_buckets:
            st.order_seen.append(i)  # only the first step's order is ever used
        b = self._plan.bucket_of[i]
        st.remaining[b] -= 1
        if st.remaining[b] == 0:  # buckets launch in order: only a full one can start any
            self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        buckets, st = self._plan.buckets, self._st
        while st.next_bucket < len(buckets) and st.remaining[st.next_bucket] == 0:
            b = buckets[st.next_bucket]
            self._gather_bucket(b.index)
            compressor = self._compressor if st.steps_synced > 0 else self._dense
            ref = BucketRef(b.index, st.steps_synced, self._layouts[b.index])
            st.pending.append(compressor.reduce(ref, self._flat[b.start : b.end], self._comm))
            st.next_bucket += 1

    def _gather_bucket(self, k: int) -> None:
        """Move autograd's fresh gradients of bucket ``k`` into the buffer, in one batched copy.

        Gradients already in place (accumulated into their views) stay; every ``param.grad``
        of the bucket is its view afterwards. Autograd's tensors are kept until the next
        forward unless ``gradient_as_bucket_view`` (see :meth:`forward` for why).
        """
        params, views = self._members[k]
        src: list[torch.Tensor] = []
        dst: list[torch.Tensor] = []
        for p, v in zip(params, views, strict=True):
            g = p.grad
            if g is not None and g.data_ptr() != v.data_ptr():
                src.append(g)
                dst.append(v)
                p.grad = v
        if src:
            torch._foreach_copy_(dst, src)
            if self._keep_spent:
                self._spent.extend(src)

    def _finish_backward(self) -> None:
        try:
            self._flush_unready()
            t0 = time.perf_counter()
            for pending in self._st.pending:
                pending.wait()
            self.finish_buffer_sync()
            exposed = time.perf_counter() - t0
            if self.config.find_unused_parameters:
                self._drop_globally_unused()
            self._st.last_stats = StepStats(
                step=self._st.steps_synced,
                collectives=len(self._st.pending),
                wire_bytes=sum(p.wire_bytes for p in self._st.pending),
                dense_bytes=self._flat.numel() * self._flat.element_size(),
                exposed_comm_s=exposed,
            )
            if self._st.steps_synced == 0 and self.config.rebuild_buckets:
                self._rebuild_from_observed_order()
            if self.tuning_pending:
                self._tune(time.perf_counter() - self._st.t_first_ready)
            self._st.steps_synced += 1
            self._st.syncs_done += 1
            self._st.used = [False] * len(self._params)
        finally:
            self._reset_backward_state()

    # -- bucket tuning ------------------------------------------------------------------
    @property
    def tuning_pending(self) -> bool:
        """True while the bucket sizes are still being measured (the same on every rank)."""
        return self.config.autotune_buckets and self.bucket_tuning is None

    def _tune(self, backward_s: float) -> None:
        """Measure the bucket plans of :mod:`syncline.dp.tuning` in turn; then keep the best.

        Called at the end of every synchronised backward with the time from the first ready
        gradient to the end of communication: the only part of a step that bucket sizes
        change (no collective is in flight before the first gradient is ready). Two phases,
        as successive halving: every candidate for ``tune_rounds`` rounds, then the ones
        within ``tune_keep_margin`` of the best for ``tune_final_rounds`` more.
        """
        t = self._st.syncs_done
        if self._tuner is None:
            self._tuner = self._make_tuner(start_step=t + 2)
            if self._tuner is None:  # a single candidate: nothing to measure
                self.bucket_tuning = {"chosen": "default", "candidates": [], "decided_at": t}
            return
        tuner = self._tuner
        pos = tuner.schedule.candidate_at(t)
        if pos is not None:
            tuner.samples[tuner.racing[pos]].append(backward_s)
        if t + 1 == tuner.schedule.end_step:
            combined = self._gather_times(tuner)
            keep = survivors(combined, tuner.racing, self.config.tune_keep_margin)
            if tuner.screening and len(keep) > 1:
                tuner.screening = False
                tuner.racing = keep
                tuner.schedule = TuningSchedule(
                    len(keep),
                    self.config.tune_steps_per_trial,
                    self.config.tune_final_rounds,
                    t + 1,
                )
            else:
                self._decide(tuner, combined, keep, t)
                return
        nxt = tuner.schedule.candidate_at(t + 1)
        if nxt is not None and tuner.racing[nxt] != tuner.active:
            tuner.active = tuner.racing[nxt]
            self._cut(tuner.plans[tuner.active])

    def _make_tuner(self, start_step: int) -> _Tuner | None:
        cfg = self.config
        elem = self._flat.element_size()
        cands, plans, seen = [], [], set()
        for c in bucket_candidates(
            self._plan.total_numel * elem,
            default_first=self._caps[0],
            default_cap=self._caps[1],
            min_bytes=max(1, int(cfg.tune_min_bucket_mb * 2**20)),
        ):
            plan = self._plan_for(self._plan.order, c.first_cap_bytes, c.cap_bytes)
            cuts = tuple(b.end for b in plan.buckets)
            if cuts not in seen:  # caps that cut this model the same way are one candidate
                seen.add(cuts)
                cands.append(c)
                plans.append(plan)
        if len(cands) < 2:
            return None
        schedule = TuningSchedule(len(cands), cfg.tune_steps_per_trial, cfg.tune_rounds, start_step)
        return _Tuner(cands, plans, schedule, racing=list(range(len(cands))))

    def _gather_times(self, tuner: _Tuner) -> list[list[float]]:
        """Every rank's times so far, combined per step (the same on every rank)."""
        lengths = [len(s) for s in tuner.samples]  # the same on every rank: same schedule
        mine = torch.tensor(
            [x for s in tuner.samples for x in s], dtype=torch.float64, device=self._flat.device
        )
        pending, gathered = self._comm.allgather(
            mine, f"bucket tuning measurements at step {self._st.steps_synced}"
        )
        pending.wait()
        per_rank = []
        for g in gathered:
            flat, rows, at = g.tolist(), [], 0
            for n in lengths:
                rows.append(flat[at : at + n])
                at += n
            per_rank.append(rows)
        return min_over_ranks(per_rank)

    def _decide(
        self, tuner: _Tuner, combined: list[list[float]], among: list[int], step: int
    ) -> None:
        """Adopt the fastest plan of ``among`` (the default unless clearly beaten)."""
        best = choose(combined, among=among)
        chosen = tuner.candidates[best]
        self._caps = (chosen.first_cap_bytes, chosen.cap_bytes)  # kept if the layout changes
        self._cut(tuner.plans[best])
        self.bucket_tuning = {
            "chosen": chosen.label,
            "buckets": len(tuner.plans[best].buckets),
            "decided_at": step,
            "candidates": [
                {
                    "label": c.label,
                    "first_cap_bytes": c.first_cap_bytes,
                    "cap_bytes": c.cap_bytes,
                    "buckets": len(p.buckets),
                    "steps": len(s),
                    "median_backward_ms": 1e3 * statistics.median(s) if s else None,
                    "final": k in among,
                }
                for k, (c, p, s) in enumerate(
                    zip(tuner.candidates, tuner.plans, combined, strict=True)
                )
            ],
        }
        self._tuner = None

    def _flush_unready(self) -> None:
        unready = [i for i, r in enumerate(self._st.ready) if not r]
        if unready and not self.config.find_unused_parameters:
            names = [self._names[i] for i in unready]
            raise RuntimeError(
                f"DataParallel: {len(names)} parameter(s) got no gradient in step "
                f"{self._st.steps_synced}: {names[:8]}; pass find_unused_parameters=True, or "
                "make every parameter take part in the loss"
            )
        for i in unready:
            p, view = self._params[i], self._views[i]
            if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                view.zero_()
                p.grad = view
            self._st.ready[i] = True
            self._st.remaining[self._plan.bucket_of[i]] -= 1
        self._launch_ready_buckets()

    def _drop_globally_unused(self) -> None:
        """A parameter no rank used keeps ``grad=None``, so optimizers skip it (as in DDP)."""
        used = torch.tensor(self._st.used, dtype=torch.int32, device=self._flat.device)
        self._comm.allreduce(used, f"unused-parameter count at step {self._st.steps_synced}").wait()
        for i, count in enumerate(used.tolist()):
            if count == 0:
                self._params[i].grad = None

    def _rebuild_from_observed_order(self) -> None:
        seen = list(dict.fromkeys(self._st.order_seen))
        seen_set = set(seen)
        rest = [i for i in self._plan.order if i not in seen_set]
        order = torch.tensor(seen + rest, dtype=torch.int64)
        comm.broadcast_tensors([order], group=self.process_group, what="bucket order")
        new_order = order.tolist()
        if tuple(new_order) != self._plan.order:
            self._install_plan(new_order, keep_grads=True)

    def sync_gradients(self) -> StepStats:
        """Average the whole gradient buffer now, bucket by bucket (outside any backward).

        Useful after accumulating under :meth:`no_sync` without a final synchronised
        backward, and for benchmarks that time the collective path alone.
        """
        self._attach_grads()
        pending = []
        for b in self._plan.buckets:
            ref = BucketRef(b.index, self._st.steps_synced, self._layouts[b.index])
            pending.append(self._dense.reduce(ref, self._flat[b.start : b.end], self._comm))
        t0 = time.perf_counter()
        for p in pending:
            p.wait()
        return StepStats(
            step=self._st.steps_synced,
            collectives=len(pending),
            wire_bytes=sum(p.wire_bytes for p in pending),
            dense_bytes=self._flat.numel() * self._flat.element_size(),
            exposed_comm_s=time.perf_counter() - t0,
        )

    # -- state --------------------------------------------------------------------------
    def compression_state_dict(self) -> dict[str, Any]:
        """The compressor's state (residuals, factors), for checkpoints."""
        return {
            "name": self._compressor.name,
            "steps_synced": self._st.steps_synced,
            "bucket_order": list(self._plan.order),
            "state": self._compressor.state_dict(),
        }

    def load_compression_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("name") != self._compressor.name:
            raise ConfigError(
                f"checkpoint compressor {state.get('name')!r} != configured "
                f"{self._compressor.name!r}"
            )
        order = list(state["bucket_order"])
        if tuple(order) != self._plan.order:
            self._install_plan(order, keep_grads=True)
            self._tuner = None  # its plans were cut for the old layout; tuning starts over
        self._st.steps_synced = int(state["steps_synced"])
        self._compressor.load_state_dict(state["state"])

    def install_hooks(self) -> None:
        """Attach the ready-hooks to the parameters (done at construction; again after
        :meth:`remove_hooks`). Idempotent."""
        if not self._hooks:
            self._hooks = [
                p.register_post_accumulate_grad_hook(self._make_hook(i))
                for i, p in enumerate(self._params)
            ]

    def remove_hooks(self) -> None:
        """Detach from the module's parameters (e.g. before wrapping it again)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


class _StepState:
    """The engine's per-step bookkeeping, kept off the ``nn.Module``.

    A module's ``__setattr__`` costs ~10 us a call (it checks for parameters, buffers and
    submodules); the engine set ~17 attributes a step, 0.2 ms of a 9 ms CNN step. Here
    attributes are plain slots.
    """

    __slots__ = (
        "buffer_sync",
        "in_backward",
        "last_stats",
        "next_bucket",
        "order_seen",
        "pending",
        "ready",
        "remaining",
        "steps_synced",
        "sync_this_backward",
        "syncs_done",
        "t_first_ready",
        "used",
    )

    def __init__(self, num_params: int) -> None:
        self.buffer_sync: Pending | None = None
        self.sync_this_backward = True
        self.used = [False] * num_params
        self.steps_synced = 0
        self.syncs_done = 0  # synchronised backwards since construction (the tuning clock)
        self.t_first_ready = 0.0
        self.last_stats = StepStats()
        self.ready: list[bool] = []
        self.remaining: list[int] = []
        self.next_bucket = 0
        self.pending: list[Pending] = []
        self.in_backward = False
        self.order_seen: list[int] = []


@dataclass
class _Tuner:
    """Bucket tuning in progress: the candidates, their plans over the buffer, the times."""

    candidates: list[BucketCandidate]
    plans: list[BucketPlan]
    schedule: TuningSchedule  # over positions in ``racing``
    racing: list[int]  # candidates measured in this phase
    screening: bool = True  # first phase: every candidate; then the close ones
    active: int = 0
    samples: list[list[float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.samples = [[] for _ in self.candidates]


def _resolve_collective(allreduce: str | Collective, group: comm.Group, timeout_s: float) -> Any:
    if isinstance(allreduce, str):
        if allreduce != "flat":
            raise ConfigError(
                f"allreduce={allreduce!r} is not known here; valid: 'flat', or pass a "
                "Collective instance (e.g. a hierarchical one built from a topology)"
            )
        return FlatAllreduce(group, timeout_s=timeout_s)
    return allreduce
