"""The bucket plan is pure data: literal layouts, invariants, and bad input."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from syncline.dp.buckets import plan_buckets
from syncline.errors import ConfigError


def test_literal_plan_reverse_order_with_small_first_bucket() -> None:
    plan = plan_buckets(
        [4, 2, 8, 3], order=[3, 2, 1, 0], element_size=4, cap_bytes=40, first_cap_bytes=8
    )
    assert [(b.start, b.end, b.params) for b in plan.buckets] == [
        (0, 3, (3,)),
        (3, 13, (2, 1)),
        (13, 17, (0,)),
    ]
    assert plan.offsets == (13, 11, 3, 0)
    assert plan.bucket_of == (2, 1, 1, 0)
    assert plan.total_numel == 17


def test_one_huge_cap_gives_one_bucket() -> None:
    plan = plan_buckets([5, 5, 5], order=[2, 1, 0], element_size=4, cap_bytes=10**9)
    assert len(plan.buckets) == 1
    assert plan.buckets[0].params == (2, 1, 0)


@given(
    st.lists(st.integers(1, 50), min_size=1, max_size=30),
    st.integers(1, 400),
    st.integers(1, 400),
    st.randoms(use_true_random=False),
)
def test_plan_invariants(numels, cap, first, rnd) -> None:
    order = list(range(len(numels)))
    rnd.shuffle(order)
    plan = plan_buckets(numels, order, 4, cap, first)
    # buckets tile the buffer, in order, without gaps
    assert plan.buckets[0].start == 0
    for a, b in zip(plan.buckets, plan.buckets[1:], strict=False):
        assert a.end == b.start
    assert plan.total_numel == sum(numels)
    # every parameter sits in exactly one bucket, inside its range, in the given order
    flat_order = [i for b in plan.buckets for i in b.params]
    assert flat_order == order
    for b in plan.buckets:
        for i in b.params:
            assert b.start <= plan.offsets[i] and plan.offsets[i] + numels[i] <= b.end
            assert plan.bucket_of[i] == b.index
    # every bucket but the last reached its cap
    for b in plan.buckets[:-1]:
        assert b.numel * 4 >= (first if b.index == 0 else cap)


@pytest.mark.parametrize(
    ("numels", "order", "cap", "match"),
    [
        ([1, 2], [0, 0], 8, "permutation"),
        ([1, 0], [0, 1], 8, "numel > 0"),
        ([1, 2], [1, 0], 0, "cap_bytes=0"),
    ],
)
def test_bad_input(numels, order, cap, match) -> None:
    with pytest.raises(ConfigError, match=match):
        plan_buckets(numels, order, 4, cap)


def test_literal_plan_with_two_dtypes() -> None:
    """One flat buffer per dtype: a bucket never mixes them; each kind fills its own bucket
    in ``order``, buckets launch as they close, and the open ones last (first-seen first)."""
    plan = plan_buckets(
        [4, 2, 8, 3],
        order=[3, 2, 1, 0],
        element_size=[4, 8],
        cap_bytes=40,
        first_cap_bytes=8,
        kinds=[0, 1, 0, 1],
    )
    assert [(b.flat, b.start, b.end, b.params) for b in plan.buckets] == [
        (1, 0, 3, (3,)),  # 24 bytes of kind 1 close the first bucket (cap 8)
        (0, 0, 12, (2, 0)),  # kind 0 reaches 48 bytes >= 40 with parameter 0
        (1, 3, 5, (1,)),  # still open at the end
    ]
    assert plan.offsets == (8, 3, 0, 0)
    assert plan.flat_numels == (12, 5)
    assert plan.bucket_of == (1, 2, 1, 0)
    assert plan.total_numel == 17


@given(
    st.lists(st.tuples(st.integers(1, 50), st.integers(0, 2)), min_size=1, max_size=30),
    st.integers(1, 400),
    st.randoms(use_true_random=False),
)
def test_plan_invariants_with_kinds(params, cap, rnd) -> None:
    numels = [n for n, _ in params]
    kinds = [k for _, k in params]
    order = list(range(len(numels)))
    rnd.shuffle(order)
    plan = plan_buckets(numels, order, [2, 4, 8], cap, kinds=kinds)
    for k in range(3):  # each flat buffer is tiled by its buckets, in order, without gaps
        mine = [b for b in plan.buckets if b.flat == k]
        assert [b.start for b in mine] == ([0] + [b.end for b in mine[:-1]] if mine else [])
        assert plan.flat_numels[k] == sum(n for n, kk in params if kk == k)
        assert [i for b in mine for i in b.params] == [i for i in order if kinds[i] == k]
    for b in plan.buckets:
        for i in b.params:
            assert kinds[i] == b.flat
            assert b.start <= plan.offsets[i] and plan.offsets[i] + numels[i] <= b.end


def test_bad_kinds() -> None:
    with pytest.raises(ConfigError, match="must index element_size"):
        plan_buckets([1, 2], [1, 0], [4], 8, kinds=[0, 1])
