"""torch's join protocol for uneven inputs, and the few collectives a joinable's bookkeeping
needs, kept in the one layer that calls ``torch.distributed``.

``torch.distributed.algorithms.join`` defines the protocol (:class:`Joinable`,
:class:`JoinHook`) and runs it (:class:`Join`): while a rank that ran out of inputs waits in
``Join.__exit__``, each further iteration of the others is announced by an allreduce
(:func:`notify`), and the joined rank's hook issues the same collectives the others do, so
nothing hangs. The data-parallel engine implements the protocol over torch's own classes, so
``Join([model, optimizer])`` mixes a :class:`~syncline.dp.DataParallel` with any of torch's
joinables (``ZeroRedundancyOptimizer``) as it mixes a DDP.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from syncline.comm.collectives import FlatAllreduce, Pending
from syncline.comm.groups import Group, comm_error, global_rank, group_rank, is_initialized
from syncline.errors import CommError

__all__ = [
    "Join",
    "JoinHook",
    "Joinable",
    "agree_count",
    "common_rank",
    "join_group",
    "notify",
]


def join_group(group: Group) -> Group:
    """The process group object ``group`` stands for (``None``: the default group itself, as
    DDP and ``ZeroRedundancyOptimizer`` name it), so that :class:`Join`, which refuses
    joinables on different groups, sees one group where they share it."""
    if group is None and is_initialized():
        return dist.GroupMember.WORLD
    return group


def notify(joinable: Joinable, *, timeout_s: float) -> Pending | None:
    """Announce that this rank has not joined (``Join.notify_join_context``): the allreduce
    each joined rank's ``Join`` loop waits on, issued by the first joinable of a context only.

    Returns:
        That allreduce, in flight (``None`` when this joinable does not issue it).

    Raises:
        RuntimeError: under ``throw_on_early_termination=True``, once some rank has joined:
            torch's own "Detected at least one rank that exhausted inputs", on every rank
            still training, as with DDP.
    """
    work = Join.notify_join_context(joinable)
    if work is None:
        return None
    return Pending([work], "join notice (this rank has inputs left)", timeout_s, global_rank())


def common_rank(candidate: bool, *, group: Group, device: torch.device, timeout_s: float) -> int:
    """The largest group rank among those that pass ``candidate=True`` (the ranks whose state
    is authoritative: still training, or the last to join), agreed by every rank.

    DDP's rule: under ``join()``, buffers are sent from the largest rank still training
    (rank 0 may have joined and hold stale ones), and the final model from the largest of
    the last ranks to join.

    Raises:
        CommError: no rank was a candidate (the callers make sure one is).
    """
    what = "join: agreeing on the authoritative rank"
    mine = torch.tensor([group_rank(group) if candidate else -1], device=device)
    try:
        work = dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group, async_op=True)
    except RuntimeError as exc:
        raise comm_error(global_rank(), what, exc, timeout_s) from exc
    Pending([work], what, timeout_s, global_rank()).wait()
    rank = int(mine.item())
    if rank < 0:
        raise CommError(f"rank {global_rank()}: {what}: no rank was a candidate")
    return rank


def agree_count(
    mine: bool, *, group: Group, device: torch.device, timeout_s: float, what: str
) -> tuple[Pending, torch.Tensor]:
    """Start summing one flag over the ranks (how many ranks' flag is set); read the tensor
    after waiting on the :class:`Pending`."""
    flag = torch.tensor([1 if mine else 0], dtype=torch.int64, device=device)
    return FlatAllreduce(group, timeout_s=timeout_s).allreduce(flag, what), flag
