"""Every rank must wrap the same model: compared before the initial broadcast sends anything.

DDP's ``_verify_param_shape_across_processes`` compares sizes on the ranks that differ; here
every rank gets every rank's list of names, shapes and dtypes, so every rank raises the same
:class:`~syncline.errors.ConfigError`, naming the first difference, instead of one aborting
inside the broadcast while its peers wait.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from syncline import comm
from syncline.errors import ConfigError

__all__ = ["check_same_on_all_ranks"]

Signature = list[tuple[str, tuple[int, ...], str]]


def _signature(named: Sequence[tuple[str, torch.Tensor]]) -> Signature:
    return [(n, tuple(t.shape), str(t.dtype)) for n, t in named]


def check_same_on_all_ranks(
    module: nn.Module,
    ignored: frozenset[str],
    broadcast_buffers: bool,
    group: comm.Group,
    timeout_s: float,
) -> None:
    """Compare every rank's trainable parameters (DDP's ``_verify_param_shape_across_processes``)
    and the other tensors the initial broadcast sends, before it sends them.

    Every rank gets every rank's list, so all raise the same :class:`ConfigError` together
    (naming the first difference of the lowest differing rank) instead of one aborting inside
    the broadcast and the others waiting for it.
    """
    named = [(n, p) for n, p in module.named_parameters() if n not in ignored]
    trainable = [(n, p) for n, p in named if p.requires_grad]
    others: list[tuple[str, torch.Tensor]] = [(n, p) for n, p in named if not p.requires_grad]
    if broadcast_buffers:
        others += [(f"buffer {n}", b) for n, b in module.named_buffers() if n not in ignored]
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
