"""Chunk arithmetic for coarse-grained sparse communication: score, select, pack, unpack.

Pure functions of tensors and integers (no communication), so CSC's selection rule can be
tested against literal tables. A flat buffer of ``n`` elements is cut into
``ceil(n / C)`` chunks of ``C`` elements; the last one holds ``n - (N-1)*C``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def num_chunks(numel: int, chunk_elems: int) -> int:
    """How many chunks of ``chunk_elems`` cover ``numel`` elements (the last may be short)."""
    return -(-numel // chunk_elems)


def chunks_to_send(density: float, n_chunks: int) -> int:
    """``ceil(density * n_chunks)``, at least 1 and at most ``n_chunks`` (REFERENCE.md step 3).

    A relative slack of 1e-9 keeps float noise from adding a chunk: ``0.07 * 100`` is
    ``7.000000000000001`` in binary floating point, and should select 7 chunks, not 8.
    """
    k = math.ceil(density * n_chunks * (1.0 - 1e-9))
    return max(1, min(n_chunks, k))


def chunk_scores(v: torch.Tensor, chunk_elems: int) -> torch.Tensor:
    """``||v_j||_1`` of every chunk ``j``, in fp32 (the vector all ranks sum)."""
    n_chunks = num_chunks(v.numel(), chunk_elems)
    pad = n_chunks * chunk_elems - v.numel()
    return F.pad(v.detach().abs().float(), (0, pad)).view(n_chunks, chunk_elems).sum(dim=1)


def select_chunks(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` highest-scoring chunk indices, ascending; ties go to the lowest index.

    Every rank calls this on the same (allreduced) scores, so every rank selects the same
    chunks. A stable descending sort keeps equal scores in index order, which makes the
    tie-break deterministic (``torch.topk`` does not promise which of equal values it keeps).

    Example:
        >>> select_chunks(torch.tensor([1.0, 3.0, 3.0, 2.0]), 2)
        tensor([1, 2])
    """
    order = torch.sort(scores, descending=True, stable=True).indices[:k]
    return torch.sort(order).values


def element_mask(
    selected: torch.Tensor, n_chunks: int, chunk_elems: int, numel: int
) -> torch.Tensor:
    """Boolean mask over the ``numel`` elements of the selected chunks."""
    chosen = torch.zeros(n_chunks, dtype=torch.bool, device=selected.device)
    chosen[selected] = True
    return chosen.repeat_interleave(chunk_elems)[:numel]


def pack(v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The selected elements of ``v``, chunk after chunk in index order (a new tensor)."""
    return v[mask]


def unpack(payload: torch.Tensor, mask: torch.Tensor, out: torch.Tensor) -> None:
    """Inverse of :func:`pack` into ``out``, which is zero outside the mask."""
    out.zero_()
    out[mask] = payload.to(out.dtype)
