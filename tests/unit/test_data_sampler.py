"""ShardedBatches: ranks agree without communication and the world size does not matter."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from syncline.data import ByteDataset, ShardedBatches, TensorPairDataset, step_seed
from syncline.data.dataset import IndexedDataset
from syncline.errors import ConfigError

GLOBAL_BATCH = 8


def _text() -> ByteDataset:
    return ByteDataset(bytes(range(256)) * 4, block_size=16)


def _pairs() -> TensorPairDataset:
    return TensorPairDataset(torch.arange(1000.0).reshape(100, 10), torch.arange(100))


@pytest.mark.parametrize("make", [_text, _pairs])
@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_concatenate_to_the_single_process_batch(
    make: Callable[[], IndexedDataset], world_size: int
) -> None:
    ds = make()
    single = ShardedBatches(ds, GLOBAL_BATCH, rank=0, world_size=1, seed=3)
    ranks = [ShardedBatches(ds, GLOBAL_BATCH, r, world_size, seed=3) for r in range(world_size)]
    for step in range(5):
        parts = [s.batch(step) for s in ranks]
        assert all(len(x) == GLOBAL_BATCH // world_size for x, _ in parts)
        x1, y1 = single.batch(step)
        assert torch.equal(torch.cat([x for x, _ in parts]), x1)
        assert torch.equal(torch.cat([y for _, y in parts]), y1)
        gx, gy = ranks[-1].global_batch(step)
        assert torch.equal(gx, x1) and torch.equal(gy, y1)


@settings(max_examples=25, deadline=None)
@given(
    world_size=st.sampled_from([1, 2, 3, 4, 6, 12]),
    seed=st.integers(-(2**40), 2**40),
    step=st.integers(0, 10**9),
)
def test_rank_slices_tile_the_global_indices(world_size: int, seed: int, step: int) -> None:
    ds = _pairs()
    ranks = [ShardedBatches(ds, 12, r, world_size, seed) for r in range(world_size)]
    whole = ranks[0].global_indices(step)
    assert whole.dtype == torch.long
    assert whole.min() >= 0 and whole.max() < len(ds)
    assert torch.equal(torch.cat([s.indices(step) for s in ranks]), whole)


def test_deterministic_given_seed_and_different_across_seeds_and_steps() -> None:
    ds = _pairs()
    a = ShardedBatches(ds, 16, 0, 1, seed=0)
    b = ShardedBatches(ds, 16, 0, 1, seed=0)
    c = ShardedBatches(ds, 16, 0, 1, seed=1)
    assert torch.equal(a.global_indices(7), b.global_indices(7))
    assert not torch.equal(a.global_indices(7), c.global_indices(7))
    assert not torch.equal(a.global_indices(7), a.global_indices(8))
    # asking out of order gives the same batch: no hidden generator state
    later = a.global_indices(9)
    a.global_indices(0)
    assert torch.equal(a.global_indices(9), later)


def test_step_seed_is_pinned() -> None:
    # changing the derivation would silently change every resumed run's data order
    assert step_seed(0, 0) == 1661183877485508305
    assert step_seed(1, 0) == 1477390237343401518
    assert step_seed(0, 1) == 2739692775532104343
    assert 0 <= step_seed(-5, 10**12) < 2**63


def test_iteration_yields_steps_in_order() -> None:
    s = ShardedBatches(_pairs(), 4, rank=1, world_size=2, seed=0)
    for step, (x, y) in enumerate(itertools.islice(s, 3)):
        ex, ey = s.batch(step)
        assert torch.equal(x, ex) and torch.equal(y, ey)
    x5, _ = next(s.batches(start_step=5))
    assert torch.equal(x5, s.batch(5)[0])


class _Empty:
    def __len__(self) -> int:
        return 0

    def get(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise AssertionError("never called")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"global_batch": 6, "world_size": 4}, "global_batch=6 is not divisible by world_size=4"),
        ({"rank": 2, "world_size": 2}, r"rank=2 is invalid for world_size=2; valid: 0 <= rank < 2"),
        ({"rank": -1}, "rank=-1"),
        ({"global_batch": 0}, "global_batch=0"),
        ({"world_size": 0}, "world_size=0"),
        ({"seed": 1.5}, "seed=1.5"),
        ({"dataset": _Empty()}, "0 samples"),
    ],
)
def test_bad_arguments_are_rejected(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {
        "dataset": _pairs(),
        "global_batch": 8,
        "rank": 0,
        "world_size": 2,
        "seed": 0,
        **kwargs,
    }
    with pytest.raises(ConfigError, match=message):
        ShardedBatches(**args)  # type: ignore[arg-type]


def test_negative_step_is_rejected() -> None:
    s = ShardedBatches(_pairs(), 4, 0, 1)
    with pytest.raises(ConfigError, match="step=-1"):
        s.batch(-1)


def test_datasets_follow_the_protocol() -> None:
    assert isinstance(_text(), IndexedDataset)
    assert isinstance(_pairs(), IndexedDataset)


def test_holdout_keeps_the_end_and_never_overlaps() -> None:
    from syncline.data import ByteDataset, holdout

    ds = TensorPairDataset(torch.arange(100), torch.arange(100))
    train, val = holdout(ds, 0.1)
    assert (len(train), len(val)) == (90, 10)
    assert val.get(torch.tensor([0, 9]))[0].tolist() == [90, 99]
    assert train.get(torch.tensor([89]))[0].tolist() == [89]
    assert holdout(ds, 0) == (ds, None)
    text_train, text_val = holdout(ByteDataset(bytes(range(100)), 4), 0.2)
    # a text cuts its token stream: no training window reads a held-out token
    assert int(text_train.data.max()) < int(text_val.data.min())
    for bad in (-0.1, 1.0, "x", True, 0.001):
        with pytest.raises(ConfigError, match="val_fraction"):
            holdout(ds, bad)  # type: ignore[arg-type]
