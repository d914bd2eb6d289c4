"""Uneven inputs: :class:`~syncline.dp.DataParallel` under DDP's ``join()`` and torch's ``Join``.

DataParallel is a ``torch.distributed.algorithms.join.Joinable``, as DDP is. A rank that ran
out of inputs waits in ``Join.__exit__``; for each further iteration of the ranks still
training, its hook (:class:`ShadowHook`) issues exactly the collectives their DataParallel
issues, in the same order, contributing nothing::

    a rank still training (forward, backward)     a joined rank (Join's loop, main_hook)
    join notice          allreduce 1              Join's count         allreduce 0
    buffer source    (b) allreduce max(rank)      buffer source    (b) allreduce max(-1)
    buffers          (b) broadcast, from it       buffers          (b) broadcast, received
    backward sync flag   allreduce 1 or 0         backward sync flag   allreduce 0, read
    buckets          (r) the compressor's, g      buckets          (r) the compressor's, zeros
    sparse gradients (r) allreduce                sparse gradients (r) allreduce, empty
    unused counts  (r,u) allreduce                unused counts  (r,u) allreduce, zeros
    bucket order   (r,1) broadcast from rank 0    bucket order   (r,1) the same
    tuning times   (r,t) allgather                tuning times   (r,t) allgather, +inf

    (b) when the buffers are synchronised before this forward; (r) when the flag says this
    forward's backward reduces; (u) find_unused_parameters; (1) the first synchronised step
    only; (t) the bucket-tuning steps where the ranks' times are combined (min over ranks:
    a joined rank's +inf is never chosen)

Once every rank has joined, :meth:`ShadowHook.post_hook` sends the model (parameters, and
buffers when they are synchronised) from the largest of the last ranks to join, as DDP.

The joined rank keeps the step count, the tuning clock and the bucket layout in step with
the others, so the next step's collectives still pair up. The gradients: every bucket is
scaled by ``1/world_size`` and joined ranks add zeros, so with
``divide_by_initial_world_size=True`` (default) they equal DDP's under ``join()`` bit for
bit; with ``False`` each step's buckets are divided by the number of ranks still training
(a collective whose world size says so), as DDP. A compressor with per-rank state (CSC,
TopK, PowerSGD: residuals sent with the next gradient) cannot be shadowed by a rank with no
gradient: refused when the hook is asked for (:func:`check_joinable`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from syncline import comm
from syncline.comm import join as comm_join
from syncline.comm.collectives import Collective, Pending
from syncline.dp.compression import BucketRef
from syncline.errors import ConfigError

if TYPE_CHECKING:
    from syncline.dp.engine import DataParallel
    from syncline.dp.reducer import Reducer

__all__ = [
    "JoinState",
    "ShadowHook",
    "announce",
    "buffer_source",
    "check_joinable",
    "hook",
    "notify",
]


class JoinState:
    """What a DataParallel keeps between the calls of one join context (off the module)."""

    __slots__ = ("divide_by_initial", "in_flight")

    def __init__(self) -> None:
        self.divide_by_initial = True
        #: this rank's join announcements, not waited on (their values are not needed)
        self.in_flight: list[Pending] = []

    def settle(self) -> None:
        """Wait for the announcements still in flight."""
        for pending in self.in_flight:
            pending.wait()
        self.in_flight.clear()


class _Remaining:
    """The engine's collective, with the number of ranks still training as its world size:
    a compressor divides each bucket by it (``divide_by_initial_world_size=False``)."""

    def __init__(self, inner: Collective, ranks: int) -> None:
        self._inner = inner
        self._ranks = ranks

    @property
    def rank(self) -> int:
        return self._inner.rank

    @property
    def world_size(self) -> int:
        return self._ranks

    @property
    def timeout_s(self) -> float:
        return self._inner.timeout_s

    def allreduce(self, tensor: torch.Tensor, what: str) -> Pending:
        return self._inner.allreduce(tensor, what)

    def allgather(self, tensor: torch.Tensor, what: str) -> tuple[Pending, list[torch.Tensor]]:
        return self._inner.allgather(tensor, what)


def check_joinable(dp: DataParallel) -> None:
    """Refuse a join where a joined rank could not shadow the others correctly.

    Raises:
        ConfigError: the compressor keeps per-rank state (residuals, factors) or a second
            process group: a rank without gradients would send its residuals, not zeros;
            or ``sync=`` is periodic.
    """
    if dp._sync.periodic:
        raise ConfigError(
            f"DataParallel.join() with sync={dp._sync.strategy.name!r}: a rank out of inputs "
            "would stop counting the optimizer steps its synchronisations follow; give every "
            "rank the same number of batches (DistributedSampler(drop_last=True))"
        )
    c = dp._compressor
    if c.stateless and not getattr(c, "wants_lane", False):
        return
    raise ConfigError(
        f"DataParallel.join() with compressor {c.name!r}: it keeps per-rank state "
        "(residuals sent with later gradients) that a rank out of inputs cannot shadow "
        "with zeros; use a stateless compressor under join() (compression=None, FP16() or "
        "BF16()), or give every rank the same number of batches "
        "(DistributedSampler(drop_last=True))"
    )


def notify(dp: DataParallel) -> None:
    """A forward of a rank still training, under an enabled join context, first: tell the
    joined ranks (torch's ``Join.notify_join_context``; raises its RuntimeError on every
    rank still training under ``throw_on_early_termination`` once some rank has joined)."""
    state: JoinState = dp._join_state
    state.settle()
    pending = comm_join.notify(dp, timeout_s=dp.config.timeout_s)
    if pending is not None:
        state.in_flight.append(pending)


def buffer_source(dp: DataParallel, candidate: bool) -> int:
    """The rank the buffers are sent from under join: the largest one still training."""
    return comm_join.common_rank(
        candidate, group=dp.process_group, device=dp.join_device, timeout_s=dp.config.timeout_s
    )


def announce(dp: DataParallel, training: bool) -> Collective | None:
    """Tell the joined ranks whether this forward's backward reduces (they shadow it if so).

    Returns:
        With ``divide_by_initial_world_size=False`` and fewer ranks training than the world:
        the collective the buckets go through, whose world size is the ranks training.
    """
    state: JoinState = dp._join_state
    pending, flag = _sync_flag(dp, training)
    if state.divide_by_initial or not training:
        state.in_flight.append(pending)
        return None
    pending.wait()
    ranks = int(flag.item())
    return None if ranks == dp._world_size else _Remaining(dp._comm, ranks)


def _sync_flag(dp: DataParallel, training: bool) -> tuple[Pending, torch.Tensor]:
    return comm_join.agree_count(
        training,
        group=dp.process_group,
        device=dp.join_device,
        timeout_s=dp.config.timeout_s,
        what="join: whether this step's backward reduces",
    )


class ShadowHook(comm_join.JoinHook):
    """The joined rank's side of :mod:`syncline.dp.join` (see the table there)."""

    def __init__(self, dp: DataParallel, divide_by_initial_world_size: bool = True) -> None:
        check_joinable(dp)
        super().__init__()
        self.dp = dp
        dp._join_state.settle()
        dp._join_state.divide_by_initial = bool(divide_by_initial_world_size)

    def main_hook(self) -> None:
        """One iteration of the ranks still training, shadowed."""
        dp = self.dp
        dp._join_state.settle()
        if dp._sync_buffers_next and dp.config.broadcast_buffers and dp._world_size > 1:
            dp._sync_buffers(candidate=False)
        pending, flag = _sync_flag(dp, False)
        pending.wait()
        reduces = int(flag.item()) > 0
        dp._sync_buffers_next = reduces  # as after a forward of the ranks still training
        if reduces:
            _shadow_backward(dp._reducer)

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank joined: the model of the largest of the last ranks to join, everywhere."""
        dp = self.dp
        dp._join_state.settle()
        src = comm_join.common_rank(
            is_last_joiner,
            group=dp.process_group,
            device=dp.join_device,
            timeout_s=dp.config.timeout_s,
        )
        tensors = [p.data for n, p in dp.module.named_parameters() if n not in dp._ignored]
        if dp.config.broadcast_buffers:
            tensors += dp._buffers_to_sync()
        comm.broadcast_tensors(
            tensors, src=src, group=dp.process_group, what=f"join: final model from rank {src}"
        )


def _shadow_backward(r: Reducer) -> None:
    """The collectives of one synchronised backward (:meth:`Reducer.finish_backward`), in
    its order, with nothing to contribute; the step count and tuning clock move on with it."""
    st, buf, step = r.st, r.buf, r.st.steps_synced
    compressor = r.compressor_at(step)
    pending = [
        compressor.reduce(
            BucketRef(k, step, buf.layouts[k]), torch.zeros_like(buf.bucket(k)), r.collective
        )
        for k in range(len(buf.plan.buckets))
    ]
    for name, p in zip(r.sparse_names, r.sparse_params, strict=True):
        empty = torch.sparse_coo_tensor(
            torch.empty((1, 0), dtype=torch.long, device=p.device),
            p.new_empty((0, *p.shape[1:])),
            p.shape,
        )
        what = f"sparse gradient {name!r} at step {step} (joined)"
        pending.append(
            comm.allreduce_sparse(empty, group=r.group, what=what, timeout_s=r.config.timeout_s)
        )
    for each in pending:
        each.wait()
    if r.config.find_unused_parameters:
        unused = len(buf.params) + len(r.sparse_params)
        counts = torch.zeros(unused, dtype=torch.int32, device=r.comm_device)
        r.collective.allreduce(counts, f"unused-parameter count at step {step}").wait()
    if step == 0 and r.config.rebuild_buckets:
        r.rebuild_from_observed_order()
    if r.tuning.pending:
        r.tuning.observe(math.inf, st.syncs_done, step)
    st.steps_synced += 1
    st.syncs_done += 1


def hook(dp: DataParallel, **kwargs: Any) -> ShadowHook:
    """``DataParallel.join_hook``: DDP's keyword ``divide_by_initial_world_size``."""
    return ShadowHook(dp, kwargs.get("divide_by_initial_world_size", True))
