"""Chunk arithmetic for coarse-grained sparse communication: score, select, pack, unpack.

Pure functions of tensors and integers (no communication), so CSC's selection rule can be
tested against literal tables. A flat buffer of ``n`` elements is cut into
``ceil(n / C)`` chunks of ``C`` elements; the last one holds ``n - (N-1)*C``.
"""

from __future__ import annotations

import math

import torch


def num_chunks(numel: int, chunk_elems: int) -> int:
    """How many chunks of ``chunk_elems`` cover ``numel`` elements (the last may be short)."""
    return -(-numel // chunk_elems)


def chunks_to_send(density: float, n_chunks: int) -> int:
    """``ceil(density * n_chunks)``, at least 1 and at most ``n_chunks`` (GradientFlow's
    coarse-grained sparse communication, Sun et al. 2019).

    A relative slack of 1e-9 keeps float noise from adding a chunk: ``0.07 * 100`` is
    ``7.000000000000001`` in binary floating point, and should select 7 chunks, not 8.
    """
    k = math.ceil(density * n_chunks * (1.0 - 1e-9))
    return max(1, min(n_chunks, k))


#: elements of ``|v|`` materialised at a time while scoring chunks (1 MiB in fp32): one
#: scratch block reused for the whole bucket, small enough to stay in cache between the
#: ``abs`` that writes it and the ``sum`` that reads it
_SCORE_BLOCK = 1 << 18


def chunk_scores(v: torch.Tensor, chunk_elems: int, *, normalise: bool = False) -> torch.Tensor:
    """``||v_j||_1`` of every chunk ``j``, in fp32 (the vector all ranks sum).

    The full chunks are a ``(N, C)`` view reduced row by row, the short last chunk (if any) on
    its own: no padded copy of ``v``. (``abs().sum`` is used rather than
    ``linalg.vector_norm(ord=1)``, which is several times slower on CPU.) ``normalise``
    scores the short last chunk as if it were full (its mean magnitude times ``C``), so it
    competes on its values rather than losing for being short.
    """
    full, tail = divmod(v.numel(), chunk_elems)
    body = v.detach()[: full * chunk_elems].view(full, chunk_elems)
    scores = torch.empty(full, dtype=torch.float32, device=v.device)
    # |v| a block of rows at a time into one reused scratch block: a fresh |v| per block (or
    # a whole-bucket copy) is a large allocation whose pages are faulted in anew each time;
    # in training that made scoring about 15x slower than in isolation (lowbw profile, NOTES)
    rows = max(1, min(full, _SCORE_BLOCK // chunk_elems))
    scratch = torch.empty(rows, chunk_elems, dtype=v.dtype, device=v.device)
    for start in range(0, full, rows):
        block = body[start : start + rows]
        part = scratch[: block.shape[0]]
        torch.abs(block, out=part)
        torch.sum(part, dim=1, dtype=torch.float32, out=scores[start : start + rows])
    if not tail:
        return scores
    last = v.detach()[full * chunk_elems :].abs().sum(dtype=torch.float32)
    if normalise:
        last = last * (chunk_elems / tail)
    return torch.cat([scores, last.reshape(1)])


def select_chunks(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` highest-scoring chunk indices, ascending; ties go to the lowest index.

    Every rank calls this on the same (allreduced) scores, so every rank selects the same
    chunks. ``torch.topk`` does not promise which of equal values it keeps, so it only finds
    the ``k``-th largest score ``t``; the selection is then every score above ``t`` and the
    lowest-indexed ones equal to it: deterministic, and linear in the number of chunks (a
    stable sort of 11 635 scores cost 0.8 ms of CSC's step, this about a fifth of it).

    Example:
        >>> select_chunks(torch.tensor([1.0, 3.0, 3.0, 2.0]), 2)
        tensor([1, 2])
    """
    n = scores.numel()
    if k >= n:
        return torch.arange(n, device=scores.device)
    if k <= 0:
        return torch.empty(0, dtype=torch.int64, device=scores.device)
    kth = torch.topk(scores, k, sorted=False).values.min()
    above = torch.nonzero(scores > kth).flatten()
    ties = torch.nonzero(scores == kth).flatten()[: k - above.numel()]
    return torch.sort(torch.cat([above, ties])).values


def _split(selected: torch.Tensor, numel: int, chunk_elems: int) -> tuple[torch.Tensor, bool]:
    """The selected *full* chunks, and whether the short last chunk is selected too.

    ``selected`` is ascending (as :func:`select_chunks` returns it), so the short last chunk,
    which has the highest index, can only be its last entry.
    """
    full = numel // chunk_elems
    if full * chunk_elems < numel and selected.numel() and int(selected[-1]) == full:
        return selected[:-1], True
    return selected, False


def pack_chunks(v: torch.Tensor, selected: torch.Tensor, chunk_elems: int) -> torch.Tensor:
    """The elements of the ``selected`` chunks of ``v``, in index order (a new tensor).

    One ``index_select`` of rows of the ``(N, C)`` view: the cost is the size of the payload,
    not of ``v`` (a boolean element mask would scan all ``n`` elements several times).
    """
    head, tail = _split(selected, v.numel(), chunk_elems)
    full = v.numel() // chunk_elems
    rows = v[: full * chunk_elems].view(full, chunk_elems).index_select(0, head).view(-1)
    return torch.cat([rows, v[full * chunk_elems :]]) if tail else rows


def zero_chunks(t: torch.Tensor, selected: torch.Tensor, chunk_elems: int) -> None:
    """Set the ``selected`` chunks of ``t`` to zero, in place."""
    head, tail = _split(selected, t.numel(), chunk_elems)
    full = t.numel() // chunk_elems
    t[: full * chunk_elems].view(full, chunk_elems).index_fill_(0, head, 0.0)
    if tail:
        t[full * chunk_elems :].zero_()


def put_chunks(
    t: torch.Tensor, selected: torch.Tensor, chunk_elems: int, values: torch.Tensor
) -> None:
    """Write ``values`` (as :func:`pack_chunks` lays them out) into the ``selected`` chunks of
    ``t``, in place; the other chunks are left as they are."""
    head, tail = _split(selected, t.numel(), chunk_elems)
    full = t.numel() // chunk_elems
    sent = head.numel() * chunk_elems
    rows = values[:sent].view(-1, chunk_elems).to(t.dtype)
    t[: full * chunk_elems].view(full, chunk_elems).index_copy_(0, head, rows)
    if tail:
        t[full * chunk_elems :].copy_(values[sent:])


def unpack_chunks(
    payload: torch.Tensor, selected: torch.Tensor, chunk_elems: int, out: torch.Tensor
) -> None:
    """Inverse of :func:`pack_chunks` into ``out``, which is zero outside the selection."""
    head, tail = _split(selected, out.numel(), chunk_elems)
    full = out.numel() // chunk_elems
    sent = head.numel() * chunk_elems
    out.zero_()
    rows = payload[:sent].view(-1, chunk_elems).to(out.dtype)
    out[: full * chunk_elems].view(full, chunk_elems).index_copy_(0, head, rows)
    if tail:
        out[full * chunk_elems :].copy_(payload[sent:])


def element_mask(
    selected: torch.Tensor, n_chunks: int, chunk_elems: int, numel: int
) -> torch.Tensor:
    """Boolean mask over the ``numel`` elements of the selected chunks."""
    chosen = torch.zeros(n_chunks, dtype=torch.bool, device=selected.device)
    chosen[selected] = True
    return chosen.repeat_interleave(chunk_elems)[:numel]


def pack(v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The masked elements of ``v`` in order (the reference :func:`pack_chunks` is tested
    against; CSC itself never builds an element mask)."""
    return v[mask]


def unpack(payload: torch.Tensor, mask: torch.Tensor, out: torch.Tensor) -> None:
    """Inverse of :func:`pack` into ``out``, which is zero outside the mask."""
    out.zero_()
    out[mask] = payload.to(out.dtype)
