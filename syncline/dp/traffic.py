"""PURE: what each built-in compressor puts on the wire per bucket, for the planner.

A compressor's registry entry (:class:`~syncline.dp.registry.CompressorSpec`) names its
traffic model, ``traffic(numel, matrices, value_bytes, **spec values) -> [(kind, bytes)]``:
the collectives (``"allreduce"`` or ``"allgather"``, bytes per rank) one bucket of ``numel``
gradient elements costs in the steady state (after any dense warm-up). ``matrices`` are the
bucket's weight shapes (PowerSGD compresses those), near-square when not known. A plug-in
compressor gives its own, and the planner prices it like these. Kept free of torch, as the
planner is.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from syncline.dp.chunk_size import MAX_CHUNK, derive_chunk_elems

__all__ = ["Traffic", "csc", "dense", "diloco", "halfwidth", "localsgd", "powersgd", "topk"]

#: one bucket's collectives: (``"allreduce"`` | ``"allgather"``, bytes per rank)
Traffic = list[tuple[str, float]]

#: CSC's largest chunk, the fixed default before chunks were derived per bucket
CSC_CHUNK = MAX_CHUNK


def dense(numel: int, matrices: Sequence[tuple[int, int]], value_bytes: int, **_: Any) -> Traffic:
    """The lossless allreduce of the values as they are."""
    return [("allreduce", value_bytes * numel)]


def halfwidth(
    numel: int, matrices: Sequence[tuple[int, int]], value_bytes: int, **_: Any
) -> Traffic:
    """fp16 or bf16 on the wire: two bytes per element."""
    return [("allreduce", 2 * numel)]


def csc(
    numel: int,
    matrices: Sequence[tuple[int, int]],
    value_bytes: int,
    *,
    density: float,
    chunk_elems: int | None = None,
    **_: Any,
) -> Traffic:
    """A score per chunk (fp32, one more for the step's flag), then the chosen chunks in
    fp16; on the average step ``density`` of the chunks (the fraction is carried). Chunks
    of ``chunk_elems``, or (``None``) the size CSC derives for the bucket."""
    if chunk_elems is None:
        chunk_elems = derive_chunk_elems(numel, density)
    chunks = -(-numel // chunk_elems)
    if density >= 1.0:
        return [("allreduce", 4), ("allreduce", 2 * numel)]
    sent = min(numel, density * chunks * chunk_elems)
    return [("allreduce", 4 * (chunks + 1)), ("allreduce", 2 * sent)]


def topk(
    numel: int, matrices: Sequence[tuple[int, int]], value_bytes: int, *, ratio: float, **_: Any
) -> Traffic:
    """Every rank's k values (fp32) and their indices (int32, int64 past 2**31) gathered."""
    k = max(1, min(numel, math.ceil(ratio * numel)))
    index = 4 if numel < 2**31 else 8
    return [("allgather", 4 * k), ("allgather", index * k)]


def _near_square(n: int) -> tuple[int, int]:
    rows = max(1, math.isqrt(n))
    return rows, -(-n // rows)


def powersgd(
    numel: int, matrices: Sequence[tuple[int, int]], value_bytes: int, *, rank: int, **_: Any
) -> Traffic:
    """P with the uncompressed rest, then Q, all fp32; P and Q each about half the low-rank
    factors' elements (exactly for square matrices). A matrix whose rank-``rank`` factors
    are not smaller than it goes dense."""
    shapes = list(matrices) or [_near_square(numel)]
    low, rest = 0, numel
    for a, b in shapes:
        if rank * (a + b) < a * b:
            low += rank * (a + b)
            rest -= a * b
    return [("allreduce", 4 * (max(rest, 0) + low / 2)), ("allreduce", 2 * low)]


# -- synchronising less often (syncline.dp.syncs): (what one synchronisation sends, every) ----
def localsgd(numel: int, value_bytes: int, *, period: int, **_: Any) -> tuple[Traffic, int]:
    """Post-local SGD, after its start: the weights in one allreduce every ``period`` steps."""
    return [("allreduce", value_bytes * numel)], period


def diloco(numel: int, value_bytes: int, *, inner_steps: int, **_: Any) -> tuple[Traffic, int]:
    """DiLoCo, after its start: the outer gradient (weight-sized) in one allreduce every
    ``inner_steps`` steps."""
    return [("allreduce", value_bytes * numel)], inner_steps
