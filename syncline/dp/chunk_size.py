"""PURE: the chunk size coarse-grained sparse communication (CSC) uses for a bucket.

Kept free of torch so that the planner prices CSC's traffic with the rule CSC itself uses
(:func:`syncline.dp.traffic.csc`); :mod:`syncline.dp.compressors.chunks` re-exports it.
"""

from __future__ import annotations

import math

#: a derived chunk is at least this many times ``1 / density`` elements: its fp32 score (4
#: bytes) then costs at most ``2 / SCORE_SHARE`` of what the chunk puts on the wire when sent
#: (``2 * density * C`` bytes a step on average, in fp16), a quarter at 8
SCORE_SHARE = 8
#: the largest derived chunk (GradientFlow's chunks; syncline's fixed default before)
MAX_CHUNK = 32768


def derive_chunk_elems(numel: int, density: float) -> int:
    """The chunk size for a bucket of ``numel`` elements at ``density``: a power of two,
    the smallest whose scores cost at most a quarter of its payload (``C >= 8 / density``),
    but never more than one step's share of the bucket (``C <= density * numel``), so that
    every bucket sends at least one chunk every step, and at most :data:`MAX_CHUNK`.

    Why: a chunk much larger than the layers it spans is chosen once in ``1 / density``
    steps and then delivers all the velocity it accumulated meanwhile in one step (with the
    fixed 32768, a 1 MiB bucket of a GPT at 1 % sent one chunk every ~9 steps, each chunk
    about once in 100 steps); small chunks follow the gradient's large coordinates closely,
    at the price of one fp32 score each.

    Example:
        >>> derive_chunk_elems(3_000_000, 0.01), derive_chunk_elems(300_000, 0.1)
        (1024, 128)
        >>> derive_chunk_elems(50_000, 0.01), derive_chunk_elems(100, 0.01)
        (256, 1)
    """
    fine = 1 << max(0, math.ceil(math.log2(SCORE_SHARE / density * (1 - 1e-12))))
    share = max(1.0, density * numel)
    coarse = 1 << math.floor(math.log2(share))
    return max(1, min(fine, coarse, MAX_CHUNK))
