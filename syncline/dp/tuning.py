"""PURE: which bucket sizes to try, in which order, and how to pick one from measured times.

The best bucket size depends on the cluster, not only the model. A bucket's allreduce can
overlap only the backward compute that follows its launch, so the last bucket's collective is
always exposed: on a slow link, buckets of half a MiB beat DDP's 1 MiB + 25 MiB, while on a
fast one where compute and communication share the same CPU cores, one bucket at the end of
backward does best (``benchmarks/results/NOTES.md``).
DDP leaves the choice to the user; Horovod's autotuner measures it. We measure too: for a few
steps each, the engine runs a short list of bucket plans in turn and keeps the fastest.

Candidates differ only in where the flat buffer is cut, never in its layout, so switching
between them moves no memory and does not change the result (each bucket is still summed
element by element).

Example:
    >>> cands = bucket_candidates(3_600_000, default_first=2**20, default_cap=25 * 2**20,
    ...                           min_bytes=2**20)
    >>> [c.label for c in cands]
    ['default (1.00 MiB + 25.00 MiB)', 'one bucket', 'cap 1.72 MiB']
    >>> s = TuningSchedule(candidates=3, steps_per_trial=2, rounds=2, start_step=2)
    >>> [s.candidate_at(t) for t in range(16)]
    [None, None, 0, 0, 1, 1, 2, 2, 2, 2, 1, 1, 0, 0, None, None]
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from syncline.errors import ConfigError
from syncline.fields import check_float, check_int

if TYPE_CHECKING:
    from syncline.dp.compression import Compressor

MIB = 2**20


@dataclass(frozen=True)
class BucketCandidate:
    """One way to cut the buffer: a first-bucket cap and a cap for the rest (bytes)."""

    first_cap_bytes: int
    cap_bytes: int
    label: str


def bucket_candidates(
    total_bytes: int, *, default_first: int, default_cap: int, min_bytes: int
) -> list[BucketCandidate]:
    """The plans worth trying for ``total_bytes`` of gradients, the default first.

    The default (DDP's small first bucket, then ``default_cap``), one bucket for everything
    (no overlap, fewest collectives: best when communication competes with compute for the
    same cores), and even caps of 1/2, 1/4, ... of the gradient bytes down to ``min_bytes``
    (more overlap, a smaller exposed last bucket: best on slow links). Caps that give the same
    cut as an earlier candidate in practice still appear once each here; the engine drops
    duplicates by their actual cut points.

    Raises:
        ConfigError: on a non-positive size.
    """
    for name, v in (
        ("total_bytes", total_bytes),
        ("default_first", default_first),
        ("default_cap", default_cap),
        ("min_bytes", min_bytes),
    ):
        check_float(f"bucket_candidates: {name}", v, above=0, finite=False)
    first = min(default_first, default_cap)
    out = [
        BucketCandidate(first, default_cap, f"default ({_size(first)} + {_size(default_cap)})"),
        BucketCandidate(total_bytes, total_bytes, "one bucket"),
    ]
    cap = total_bytes // 2
    while cap >= min_bytes:
        out.append(BucketCandidate(cap, cap, f"cap {_size(cap)}"))
        cap //= 2
    return out


def _size(nbytes: int) -> str:
    if nbytes >= MIB:
        return f"{nbytes / MIB:.2f} MiB"
    return f"{nbytes / 1024:.1f} KiB" if nbytes >= 1024 else f"{nbytes} B"


@dataclass(frozen=True)
class TuningSchedule:
    """Which candidate runs at each synchronised step while tuning (pure data).

    From ``start_step``, every candidate runs ``steps_per_trial`` steps in turn; odd rounds go
    backwards (0 1 2 2 1 0 ...) so that a slow drift of the machine favours no candidate.
    """

    candidates: int
    steps_per_trial: int
    rounds: int
    start_step: int

    def __post_init__(self) -> None:
        for name in ("candidates", "steps_per_trial", "rounds"):
            check_int(f"TuningSchedule: {name}", getattr(self, name))
        check_int("TuningSchedule: start_step", self.start_step, low=0)

    @property
    def end_step(self) -> int:
        """The first step after tuning."""
        return self.start_step + self.candidates * self.steps_per_trial * self.rounds

    def candidate_at(self, step: int) -> int | None:
        """The candidate measured at ``step``; ``None`` before and after tuning."""
        if not self.start_step <= step < self.end_step:
            return None
        trial, _ = divmod(step - self.start_step, self.steps_per_trial)
        rnd, k = divmod(trial, self.candidates)
        return k if rnd % 2 == 0 else self.candidates - 1 - k


def min_over_ranks(per_rank: Sequence[Sequence[Sequence[float]]]) -> list[list[float]]:
    """Combine every rank's times ``[rank][candidate][sample]`` into ``[candidate][sample]``.

    Per step, the shortest window over the ranks. A rank's window runs from its first ready
    gradient until the last collective completes, so it includes waiting for ranks that are
    late (noise from elsewhere: data, scheduling); the rank that reached the end last waited
    least, and its window is its own backward and the communication the plan left exposed.

    Raises:
        ConfigError: when the ranks' shapes differ.
    """
    shapes = [[len(samples) for samples in r] for r in per_rank]
    if not shapes or any(shape != shapes[0] for shape in shapes):
        raise ConfigError("min_over_ranks: every rank needs the same candidates and samples")
    return [
        [min(r[k][i] for r in per_rank) for i in range(len(per_rank[0][k]))]
        for k in range(len(per_rank[0]))
    ]


def survivors(seconds: Sequence[Sequence[float]], among: Sequence[int], margin: float) -> list[int]:
    """The candidates of ``among`` whose median is within ``margin`` of the best one's.

    The screening step of successive halving: a few steps tell a plan that is 10 % slower
    from the rest, but not 1 % apart; the close ones get more steps before the choice.

    Raises:
        ConfigError: when ``among`` is empty or one of its candidates has no measurement.
    """
    medians = _medians(seconds, among)
    best = min(medians.values())
    return [k for k in among if medians[k] <= best * (1.0 + margin)]


def choose(
    seconds: Sequence[Sequence[float]],
    tolerance: float = 0.01,
    among: Sequence[int] | None = None,
) -> int:
    """The fastest candidate by median time, keeping the default (0) unless it is beaten.

    Args:
        seconds: per candidate, its measured times (combined over ranks, e.g. by
            :func:`min_over_ranks`, so every rank that calls this picks the same one).
        tolerance: a candidate must be this fraction faster than the default to replace it,
            so measurement noise does not move a well-chosen default.
        among: the candidates still in the race (default: all).

    Raises:
        ConfigError: when a candidate of ``among`` has no measurement.
    """
    among = list(range(len(seconds))) if among is None else list(among)
    medians = _medians(seconds, among)
    best = min(among, key=medians.__getitem__)
    if 0 in medians and medians[best] >= medians[0] * (1.0 - tolerance):
        return 0
    return best


def _medians(seconds: Sequence[Sequence[float]], among: Sequence[int]) -> dict[int, float]:
    if not among or any(not 0 <= k < len(seconds) or len(seconds[k]) == 0 for k in among):
        raise ConfigError(
            f"every candidate needs measurements: candidates {list(among)} of "
            f"{[len(s) for s in seconds]} samples"
        )
    return {k: statistics.median(seconds[k]) for k in among}


def autotune_choice(compressor: Compressor, requested: bool | None, no_cap_given: bool) -> bool:
    """Whether to tune the buckets: as ``requested``, or by default unless the user chose the
    sizes; only a compressor without per-bucket state may have its buckets re-cut."""
    stateless = getattr(compressor, "stateless", None)
    if not isinstance(stateless, bool):
        raise ConfigError(
            f"compression={compressor!r} does not declare 'stateless' (True or "
            "False: whether it keeps per-bucket state); see syncline.dp.Compressor"
        )
    if requested is None:  # tune unless the user chose the sizes
        return no_cap_given and stateless
    if requested and not stateless:
        raise ConfigError(
            f"autotune_buckets=True needs a stateless compressor (none, fp16, bf16); "
            f"{compressor.name!r} keeps per-bucket state, so its buckets must not "
            "change: pass bucket_cap_mb instead"
        )
    return requested
