"""The balancer against literal tables and against brute force on small inputs."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from syncline.errors import ConfigError
from syncline.partition import balance, balance_with_memory, check_balance, stage_bounds
from tests.zoo.fresh import run_python


@pytest.mark.parametrize(
    ("costs", "stages", "want"),
    [
        ([1, 1, 1, 1], 1, [4]),
        ([1, 1, 1, 1], 2, [2, 2]),
        ([1, 1, 1, 1], 4, [1, 1, 1, 1]),
        ([1, 1, 1], 2, [1, 2]),  # tie: the first stage takes fewer layers
        ([4, 1, 1, 1, 1], 2, [1, 4]),
        ([1, 1, 1, 1, 4], 2, [4, 1]),
        ([1, 2, 3, 4, 5, 6], 3, [3, 2, 1]),
        ([0, 0, 0, 5], 2, [1, 3]),  # zero costs: still non-empty stages
        ([2, 2, 2, 2, 2, 2, 2, 2], 3, [2, 3, 3]),
        ([0.5, 3.0, 0.5, 0.5, 3.0, 0.5], 2, [3, 3]),
        ([10, 1, 1, 1, 1, 1, 1, 1, 1, 1, 10], 3, [1, 9, 1]),
    ],
)
def test_balance_table(costs: list[float], stages: int, want: list[int]) -> None:
    assert balance(costs, stages) == want


def _cost(costs: list[float], sizes: list[int]) -> float:
    return max(sum(costs[lo:hi]) for lo, hi in stage_bounds(sizes))


def _splits(n: int, k: int) -> list[list[int]]:
    out = []
    for cuts in itertools.combinations(range(1, n), k - 1):
        edges = [0, *cuts, n]
        out.append([b - a for a, b in itertools.pairwise(edges)])
    return out


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(0, 20), min_size=1, max_size=8),
    st.integers(1, 8),
)
def test_balance_is_optimal_and_first_among_optima(costs: list[int], stages: int) -> None:
    if stages > len(costs):
        with pytest.raises(ConfigError, match="more than"):
            balance(costs, stages)
        return
    got = balance(costs, stages)
    assert sum(got) == len(costs) and len(got) == stages and min(got) >= 1
    candidates = _splits(len(costs), stages)
    best = min(_cost(costs, s) for s in candidates)
    assert _cost(costs, got) == best
    assert got == min(s for s in candidates if _cost(costs, s) == best)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9)), min_size=1, max_size=7),
    st.integers(1, 4),
    st.integers(0, 30),
)
def test_balance_with_memory_matches_brute_force(
    layers: list[tuple[int, int]], stages: int, limit: int
) -> None:
    costs, mems = [c for c, _ in layers], [m for _, m in layers]
    if stages > len(costs):
        return
    feasible = [
        s
        for s in _splits(len(costs), stages)
        if all(sum(mems[lo:hi]) <= limit for lo, hi in stage_bounds(s))
    ]
    if not feasible:
        with pytest.raises(ConfigError, match="mem_limit"):
            balance_with_memory(costs, mems, stages, limit)
        return
    got = balance_with_memory(costs, mems, stages, limit)
    best = min(_cost(costs, s) for s in feasible)
    assert got in feasible
    assert _cost(costs, got) == best


def test_memory_limit_moves_the_cut() -> None:
    assert balance_with_memory([1, 1, 1, 1], [5, 1, 1, 1], 2, mem_limit=6) == [2, 2]
    assert balance_with_memory([1, 1, 1, 1], [5, 1, 1, 1], 2, mem_limit=5) == [1, 3]


@pytest.mark.parametrize(
    ("costs", "stages", "match"),
    [
        ([1, 2], 3, "num_stages=3 is more than the 2 layers"),
        ([1, 2], 0, "num_stages=0"),
        ([1, 2], -1, "num_stages=-1"),
        ([1, 2], 1.5, "num_stages=1.5"),
        ([], 1, "no layers"),
        ([1, -2], 1, r"costs\[1\]=-2"),
        ([1, float("nan")], 1, r"costs\[1\]=nan"),
        ([1, "a"], 1, r"costs\[1\]='a'"),
    ],
)
def test_balance_rejects(costs: list, stages, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        balance(costs, stages)


def test_balance_with_memory_rejects_mismatched_lengths() -> None:
    with pytest.raises(ConfigError, match="len\\(mems\\)=1 must equal len\\(costs\\)=2"):
        balance_with_memory([1, 1], [1], 1, 10)


@pytest.mark.parametrize(
    ("split", "match"),
    [
        ([2, 1], "sums to 3 layers but the module has 4"),
        ([4], "has 1 stages; valid: 2 entries"),
        ([0, 4], "ints >= 1"),
    ],
)
def test_check_balance(split: list[int], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        check_balance(split, 4, 2)
    assert check_balance([1, 3], 4, 2) == [1, 3]


def test_partition_does_not_import_torch() -> None:
    code = "import sys, syncline.partition; assert 'torch' not in sys.modules, 'torch was loaded'"
    run_python(code)


def test_balance_is_fast_enough_for_deep_models() -> None:
    sizes = balance([float(i % 7 + 1) for i in range(400)], 16)
    assert sum(sizes) == 400 and len(sizes) == 16
