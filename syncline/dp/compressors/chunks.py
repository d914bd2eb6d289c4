"""Chunk arithmetic for coarse-grained sparse communication: score, select, pack, unpack.

Pure functions of tensors and integers (no communication), so CSC's selection rule can be
tested against literal tables. A flat buffer of ``n`` elements is cut into
``ceil(n / C)`` chunks of ``C`` elements; the last one holds ``n - (N-1)*C``.
"""

from __future__ import annotations

import math

import torch

# CSC's chunk-size rule lives in a pure module (the planner prices traffic with it)
from syncline.dp.chunk_size import derive_chunk_elems as derive_chunk_elems


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

    All on the scores' device, with no host sync: ``k`` comes from shapes, so the result has
    exactly ``k`` entries whatever the values. The chosen entries are numbered by a running
    count and scattered to their place in the output (the others to one spare slot past the
    end, dropped). Should the scores hold NaN (a step that is skipped anyway), fewer than
    ``k`` may be chosen; the remaining slots then hold their own position, still valid
    chunk indices.

    Example:
        >>> select_chunks(torch.tensor([1.0, 3.0, 3.0, 2.0]), 2)
        tensor([1, 2])
    """
    n = scores.numel()
    device = scores.device
    if k >= n:
        return torch.arange(n, device=device)
    if k <= 0:
        return torch.empty(0, dtype=torch.int64, device=device)
    kth = torch.topk(scores, k, sorted=False).values.min()
    above = scores > kth
    ties = scores == kth
    room = k - above.sum()  # how many of the ties are taken, lowest index first
    take = above | (ties & (ties.cumsum(0) <= room))
    slot = torch.where(take, take.cumsum(0) - 1, k)
    out = torch.arange(k + 1, device=device)
    out.scatter_(0, slot, torch.arange(n, device=device))
    return out[:k]


def _body_tail(t: torch.Tensor, chunk_elems: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` as its full chunks (an ``(N, C)`` view) and its short last chunk (maybe empty)."""
    full = t.numel() // chunk_elems
    return t[: full * chunk_elems].view(full, chunk_elems), t[full * chunk_elems :]


def pack_chunks(v: torch.Tensor, selected: torch.Tensor, chunk_elems: int) -> torch.Tensor:
    """The ``selected`` chunks of ``v``, in index order, ``C`` elements each (a new tensor
    of ``k * C`` elements for ``k`` selected chunks).

    Fixed size, so that what goes on the wire depends on the density and the shapes only,
    never on the values (no host sync to size it): a short last chunk, when selected, is
    padded with zeros to ``C``. One ``index_select`` of rows of the ``(N, C)`` view: the cost
    is the size of the payload, not of ``v``. ``selected`` is ascending (as
    :func:`select_chunks` returns it), so the short chunk can only be its last entry; that
    row is fixed up on the device with a ``where``.
    """
    body, tail = _body_tail(v, chunk_elems)
    k, full = selected.numel(), body.shape[0]
    if not tail.numel():
        return body.index_select(0, selected).view(-1)
    if full == 0:  # the short chunk is the only one
        rows = v.new_zeros(k, chunk_elems)
        rows[:, : tail.numel()] = tail
        return rows.view(-1)
    rows = body.index_select(0, selected.clamp(max=full - 1))
    if k:
        padded = v.new_zeros(chunk_elems)
        padded[: tail.numel()] = tail
        rows[-1].copy_(torch.where(selected[-1] == full, padded, rows[-1]))
    return rows.view(-1)


def put_chunks(
    t: torch.Tensor, selected: torch.Tensor, chunk_elems: int, values: torch.Tensor
) -> None:
    """Write ``values`` (as :func:`pack_chunks` lays them out: ``C`` per selected chunk) into
    the ``selected`` chunks of ``t``, in place; the other chunks are left as they are.

    No host sync: the full chunks but the last selected one go by one ``index_copy_``; the
    last one goes either to its row or, if it is the short chunk, to the tail, decided on
    the device (its row then gets its own value back, so no row is written twice).
    """
    body, tail = _body_tail(t, chunk_elems)
    k, full = selected.numel(), body.shape[0]
    rows = values.view(k, chunk_elems).to(t.dtype)
    if not tail.numel():
        body.index_copy_(0, selected, rows)
        return
    if k == 0:
        return
    if full == 0:  # the short chunk is the only one
        tail.copy_(rows[-1, : tail.numel()])
        return
    body.index_copy_(0, selected[:-1], rows[:-1])
    last = selected[-1:]
    is_tail = last == full
    row = last.clamp(max=full - 1)
    body.index_copy_(0, row, torch.where(is_tail, body.index_select(0, row), rows[-1:]))
    tail.copy_(torch.where(is_tail, rows[-1, : tail.numel()], tail))


def zero_chunks(t: torch.Tensor, selected: torch.Tensor, chunk_elems: int) -> None:
    """Set the ``selected`` chunks of ``t`` to zero, in place: :func:`put_chunks` of zeros,
    with fills instead of copies (no host sync)."""
    body, tail = _body_tail(t, chunk_elems)
    k, full = selected.numel(), body.shape[0]
    if not tail.numel():
        body.index_fill_(0, selected, 0.0)
        return
    if k == 0:
        return
    if full == 0:  # the short chunk is the only one
        tail.zero_()
        return
    body.index_fill_(0, selected[:-1], 0.0)
    last = selected[-1:]
    is_tail = last == full
    row = last.clamp(max=full - 1)
    body.index_copy_(0, row, torch.where(is_tail, body.index_select(0, row), 0.0))
    tail.masked_fill_(is_tail, 0.0)


def unpack_chunks(
    payload: torch.Tensor, selected: torch.Tensor, chunk_elems: int, out: torch.Tensor
) -> None:
    """Inverse of :func:`pack_chunks` into ``out``, which is zero outside the selection
    (a short last chunk takes the first elements of its padded row)."""
    out.zero_()
    put_chunks(out, selected, chunk_elems, payload)


def element_mask(
    selected: torch.Tensor, n_chunks: int, chunk_elems: int, numel: int
) -> torch.Tensor:
    """Boolean mask over the ``numel`` elements of the selected chunks."""
    chosen = torch.zeros(n_chunks, dtype=torch.bool, device=selected.device)
    chosen[selected] = True
    return chosen.repeat_interleave(chunk_elems)[:numel]


def pack(v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The masked elements of ``v`` in order: the reference :func:`pack_chunks` is tested
    against (without its padding). Not for the step: CSC never builds an element mask, and
    a boolean index reads the mask on the host."""
    return v[mask]


def unpack(payload: torch.Tensor, mask: torch.Tensor, out: torch.Tensor) -> None:
    """Inverse of :func:`pack` into ``out``, which is zero outside the mask."""
    out.zero_()
    out[mask] = payload.to(out.dtype)
