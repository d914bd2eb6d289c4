"""PURE: the combinations of ``syncline train``'s options a test must cover, from the registries.

Every registered optimizer, pipeline schedule, precision, compressor, allreduce algorithm
and sync (how often replicas agree) is a value of one dimension, so a plug-in's joins the
matrix by being registered. Testing every combination is out of reach (thousands);
:func:`all_pairs` picks few cells that hold every pair of values of two dimensions (a
covering array of strength 2, the usual answer in combinatorial testing: most option bugs
need two options to meet).

A pair that no valid cell holds (e.g. a compressor with momentum correction beside LAMB's
own moments) is covered by a cell the validity check refuses: the test then shows that
combination is refused before launch, not that it trains.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from syncline.comm.registry import ALLREDUCE
from syncline.dp.config import PRECISIONS
from syncline.dp.registry import COMPRESSORS
from syncline.dp.syncs import SYNCS
from syncline.optim.registry import OPTIMIZERS
from syncline.schedule.registry import SCHEDULES

__all__ = ["Cell", "Dimension", "all_pairs", "pairs_of", "train_dimensions"]

#: one value per dimension, by dimension name
Cell = Mapping[str, str]
_Pair = tuple[tuple[str, str], tuple[str, str]]


@dataclass(frozen=True)
class Dimension:
    """One option of a run and the values the matrix gives it."""

    name: str
    values: tuple[str, ...]


def train_dimensions() -> list[Dimension]:
    """The dimensions of ``syncline train`` the matrix spans, read from the registries now.

    ``layout``: ``dp`` (data parallelism), a registered schedule (a 2-stage pipeline), or
    ``split`` (a factory's model cut at split points). ``ranks``: 2 or 4 (a pipeline on 4
    ranks has 2 replicas per stage). ``continuation``: ``resume`` (``--resume RUN_DIR``) or
    ``restart`` (a worker restarted by torchrun's ``--max-restarts``). ``validation``:
    held-out loss and a generated sample, or neither.
    """
    return [
        Dimension("optimizer", tuple(OPTIMIZERS.names())),
        Dimension("layout", ("dp", *SCHEDULES.names(), "split")),
        Dimension("ranks", ("2", "4")),
        Dimension("precision", tuple(PRECISIONS)),
        Dimension("compression", tuple(COMPRESSORS.names())),
        Dimension("allreduce", tuple(ALLREDUCE.names())),
        Dimension("sync", tuple(SYNCS.names())),
        Dimension("continuation", ("resume", "restart")),
        Dimension("validation", ("off", "on")),
    ]


def pairs_of(cell: Cell, dims: Sequence[Dimension]) -> set[_Pair]:
    """The pairs of (dimension, value) a cell holds."""
    items = [(d.name, cell[d.name]) for d in dims]
    return {(a, b) for a, b in itertools.combinations(items, 2)}


def all_pairs(
    dims: Sequence[Dimension], valid: Callable[[Cell], bool]
) -> list[tuple[dict[str, str], bool]]:
    """Cells holding every pair of values of two dimensions, each with whether it is valid.

    A pair some valid cell holds is covered by a valid cell; a pair no valid cell holds, by
    a refused one. Greedy and deterministic (no randomness, so a failing cell keeps its id):
    for the first uncovered pair, the cell holding it that covers the most uncovered pairs
    (valid cells first), ties to the first in product order.

    Args:
        dims: the dimensions, each with at least one value.
        valid: whether a cell is accepted (called at most once per cell).
    """
    names = [d.name for d in dims]
    index = {d.name: i for i, d in enumerate(dims)}
    cache: dict[tuple[str, ...], bool] = {}

    def ok(combo: tuple[str, ...]) -> bool:
        if combo not in cache:
            cache[combo] = bool(valid(dict(zip(names, combo, strict=True))))
        return cache[combo]

    def holding(pair: _Pair) -> list[tuple[str, ...]]:
        (a, va), (b, vb) = pair
        fixed = {index[a]: va, index[b]: vb}
        choices = [(fixed[i],) if i in fixed else d.values for i, d in enumerate(dims)]
        return list(itertools.product(*choices))

    def pairs(combo: tuple[str, ...]) -> set[_Pair]:
        return pairs_of(dict(zip(names, combo, strict=True)), dims)

    possible: dict[_Pair, bool] = {}

    def can_hold(pair: _Pair) -> bool:
        if pair not in possible:
            possible[pair] = any(ok(c) for c in holding(pair))
        return possible[pair]

    uncovered = sorted(
        ((a.name, va), (b.name, vb))
        for a, b in itertools.combinations(dims, 2)
        for va in a.values
        for vb in b.values
    )
    remaining = set(uncovered)
    cells: list[tuple[dict[str, str], bool]] = []
    for first in uncovered:
        if first not in remaining:
            continue
        candidates = holding(first)
        good = [c for c in candidates if ok(c)]
        if good:
            best = max(good, key=lambda c: len(pairs(c) & remaining))
            remaining -= pairs(best)
        else:  # refused whatever else it meets: cover the other impossible pairs it can
            best = max(
                candidates,
                key=lambda c: sum(1 for p in pairs(c) & remaining if not can_hold(p)),
            )
            remaining -= {p for p in pairs(best) & remaining if not can_hold(p)}
            remaining.discard(first)
        cells.append((dict(zip(names, best, strict=True)), bool(good)))
    return cells
