"""The covering array behind the option-matrix test: every pair of values in some cell,
valid cells wherever a valid cell can hold the pair, the same cells on every run."""

from __future__ import annotations

import itertools

from syncline.optim.registry import OPTIMIZERS
from syncline.testing.matrix import Dimension, all_pairs, pairs_of, train_dimensions

DIMS = [
    Dimension("opt", ("adamw", "sgd", "lamb")),
    Dimension("comp", ("none", "csc", "topk", "fp16")),
    Dimension("layout", ("dp", "pipe")),
    Dimension("ranks", ("2", "4")),
]


def _momentum_twice(cell) -> bool:
    """Refused: csc's momentum beside an adaptive optimizer; compression on a pipeline of 2."""
    if cell["comp"] == "csc" and cell["opt"] != "sgd":
        return False
    return not (cell["layout"] == "pipe" and cell["ranks"] == "2" and cell["comp"] != "none")


def _every_pair() -> set:
    return {
        ((a.name, va), (b.name, vb))
        for a, b in itertools.combinations(DIMS, 2)
        for va in a.values
        for vb in b.values
    }


def test_every_pair_is_in_a_cell_and_far_fewer_cells_than_the_product() -> None:
    cells = all_pairs(DIMS, lambda cell: True)
    covered = set().union(*(pairs_of(c, DIMS) for c, _ in cells))
    assert covered == _every_pair()
    assert all(valid for _, valid in cells)
    assert 12 <= len(cells) < 3 * 4 * 2 * 2  # at least |opt| x |comp|, less than all


def test_a_pair_a_valid_cell_can_hold_is_held_by_one_and_the_others_by_refused_cells() -> None:
    cells = all_pairs(DIMS, _momentum_twice)
    for cell, valid in cells:
        assert valid == _momentum_twice(cell)
    valid_pairs = set().union(*(pairs_of(c, DIMS) for c, ok in cells if ok))
    refused_pairs = set().union(*(pairs_of(c, DIMS) for c, ok in cells if not ok))
    possible = {
        p
        for p in _every_pair()
        if any(
            _momentum_twice(dict(zip([d.name for d in DIMS], combo, strict=True)))
            and set(p) <= set(zip([d.name for d in DIMS], combo, strict=True))
            for combo in itertools.product(*(d.values for d in DIMS))
        )
    }
    assert possible <= valid_pairs  # never only shown refused when it could train
    assert _every_pair() - possible <= refused_pairs  # the impossible ones: shown refused
    assert (("opt", "adamw"), ("comp", "csc")) not in valid_pairs
    assert all(not ok for c, ok in cells if c["opt"] == "adamw" and c["comp"] == "csc")


def test_the_cells_are_the_same_on_every_run_and_validity_is_asked_once_per_cell() -> None:
    asked: list[tuple[str, ...]] = []

    def counting(cell) -> bool:
        asked.append(tuple(cell.values()))
        return _momentum_twice(cell)

    first = all_pairs(DIMS, counting)
    assert len(asked) == len(set(asked))
    assert all_pairs(DIMS, _momentum_twice) == first


def test_the_train_dimensions_come_from_the_registries() -> None:
    from syncline.comm.registry import ALLREDUCE
    from syncline.dp.registry import COMPRESSORS
    from syncline.schedule.registry import SCHEDULES

    dims = {d.name: d.values for d in train_dimensions()}
    assert dims["optimizer"] == OPTIMIZERS.names()
    assert dims["compression"] == COMPRESSORS.names()
    assert dims["allreduce"] == ALLREDUCE.names()
    assert dims["layout"] == ("dp", *SCHEDULES.names(), "split")
