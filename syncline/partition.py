"""PURE (no torch): cut a sequence of layers into contiguous pipeline stages.

The balancer takes numbers, the profiler (``syncline.pipeline.profile``) measures them: a
pipeline runs at the pace of its slowest stage, so ``balance`` minimises the largest stage
cost, as torchgpipe's ``balance_by_time`` does (Kim et al. 2020, "torchgpipe", section 3.2).

The split is exact (a dynamic programme over suffixes, ``O(k * n log n)``): ``best[k][i]``,
the least bottleneck of ``costs[i:]`` in ``k`` stages, is ``min_j max(cost(i, j),
best[k-1][j])``; the first term grows with ``j`` and the second shrinks, so the minimum sits
where they cross and a binary search finds it. Ties are broken deterministically: among the
optimal splits the lexicographically smallest one is returned, i.e. earlier stages take as
few layers as possible. Stage 0 holds the most micro-batches in flight under 1F1B and 2BW
(``d`` against 1 on the last stage), so leaving it the lighter side of a tie is the cheaper
choice for memory.

Example:
    >>> balance([1, 1, 1, 1], 2)
    [2, 2]
    >>> balance([1, 1, 1], 2)
    [1, 2]
    >>> balance([4, 1, 1, 1, 1], 2)
    [1, 4]
    >>> stage_bounds([1, 4])
    [(0, 1), (1, 5)]
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence

from syncline.errors import ConfigError
from syncline.fields import check_int

__all__ = ["balance", "balance_with_memory", "check_balance", "stage_bounds"]

_INF = math.inf


def _check_values(name: str, values: Sequence[float]) -> list[float]:
    out = []
    for i, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{name}[{i}]={value!r} is invalid; valid: a number >= 0")
        if not math.isfinite(value) or value < 0:
            raise ConfigError(f"{name}[{i}]={value!r} is invalid; valid: a finite number >= 0")
        out.append(float(value))
    return out


def _check_stages(num_layers: int, num_stages: int) -> None:
    check_int("num_stages", num_stages)
    if num_layers == 0:
        raise ConfigError("no layers to balance; valid: at least one layer cost")
    if num_stages > num_layers:
        raise ConfigError(
            f"num_stages={num_stages} is more than the {num_layers} layers; "
            f"valid: 1 <= num_stages <= {num_layers}"
        )


def _prefix(values: Sequence[float]) -> list[float]:
    out = [0.0]
    for value in values:
        out.append(out[-1] + value)
    return out


def _solve(n: int, k: int, seg: Callable[[int, int], float]) -> tuple[float, list[int]]:
    """Least bottleneck of ``n`` layers in ``k`` stages, and the lexicographically first split.

    ``seg(i, j)`` is the cost of a stage holding layers ``i..j-1``; it must not decrease as
    ``j`` grows (nor as ``i`` shrinks), which holds for sums of non-negative numbers and for
    "infinite when over a memory limit".
    """
    # best[s][i]: least bottleneck of layers i..n-1 in s stages (defined for i <= n - s)
    best = [[_INF] * (n + 1) for _ in range(k + 1)]
    for i in range(n):
        best[1][i] = seg(i, n)
    for s in range(2, k + 1):
        for i in range(n - s + 1):
            lo, hi = i + 1, n - s + 1  # first stage is i..j-1 with j in [lo, hi]
            # smallest j where the first stage is at least as costly as the rest
            js = range(lo, hi + 1)

            def crossed(j: int, i: int = i, s: int = s) -> bool:
                return seg(i, j) >= best[s - 1][j]

            at = bisect.bisect_left(js, True, key=crossed)
            candidates = js[max(at - 1, 0) : at + 1]
            best[s][i] = min(max(seg(i, j), best[s - 1][j]) for j in candidates)
    target = best[k][0]
    sizes, i = [], 0
    for s in range(k, 1, -1):
        # the first j that still lets the remaining stages stay within the optimum
        j = next(j for j in range(i + 1, n - s + 2) if max(seg(i, j), best[s - 1][j]) <= target)
        sizes.append(j - i)
        i = j
    sizes.append(n - i)
    return target, sizes


def balance(costs: Sequence[float], num_stages: int) -> list[int]:
    """Split layers into ``num_stages`` contiguous stages minimising the largest stage cost.

    Args:
        costs: one non-negative cost per layer (e.g. forward + backward seconds).
        num_stages: number of stages, ``1 <= num_stages <= len(costs)``.

    Returns:
        Layers per stage, in order; sums to ``len(costs)``, every entry >= 1. Among optimal
        splits, the lexicographically smallest (earlier stages take fewer layers).

    Raises:
        ConfigError: no costs, a negative or non-finite cost, or ``num_stages`` not in
            ``[1, len(costs)]``.

    Example:
        >>> balance([1, 2, 3, 4, 5, 6], 3)
        [3, 2, 1]
    """
    values = _check_values("costs", costs)
    _check_stages(len(values), num_stages)
    prefix = _prefix(values)
    _, sizes = _solve(len(values), num_stages, lambda i, j: prefix[j] - prefix[i])
    return sizes


def balance_with_memory(
    costs: Sequence[float], mems: Sequence[float], num_stages: int, mem_limit: float
) -> list[int]:
    """Like :func:`balance`, but every stage's summed ``mems`` must stay within ``mem_limit``.

    Args:
        costs: per-layer cost.
        mems: per-layer memory (e.g. weight bytes * versions + stashed activation bytes).
        num_stages: number of stages.
        mem_limit: the most memory one stage may hold.

    Raises:
        ConfigError: as :func:`balance`; ``mems`` of another length; or no split fits.

    Example:
        >>> balance_with_memory([1, 1, 1, 1], [5, 1, 1, 1], 2, mem_limit=6)
        [2, 2]
        >>> balance_with_memory([1, 1, 1, 1], [5, 1, 1, 1], 2, mem_limit=5)
        [1, 3]
    """
    values = _check_values("costs", costs)
    memory = _check_values("mems", mems)
    if len(memory) != len(values):
        raise ConfigError(f"len(mems)={len(memory)} must equal len(costs)={len(values)}")
    if isinstance(mem_limit, bool) or not isinstance(mem_limit, int | float) or mem_limit < 0:
        raise ConfigError(f"mem_limit={mem_limit!r} is invalid; valid: a number >= 0")
    _check_stages(len(values), num_stages)
    cost_sum, mem_sum = _prefix(values), _prefix(memory)

    def seg(i: int, j: int) -> float:
        return cost_sum[j] - cost_sum[i] if mem_sum[j] - mem_sum[i] <= mem_limit else _INF

    bottleneck, sizes = _solve(len(values), num_stages, seg)
    if bottleneck == _INF:
        raise ConfigError(
            f"no split of {len(values)} layers into {num_stages} stages keeps every stage "
            f"within mem_limit={mem_limit:g} (largest layer: {max(memory):g}, "
            f"total: {mem_sum[-1]:g})"
        )
    return sizes


def check_balance(split: Sequence[int], num_layers: int, num_stages: int) -> list[int]:
    """Validate a user-given split: ``num_stages`` ints >= 1 summing to ``num_layers``.

    Raises:
        ConfigError: naming the split, its sum and the expected sizes.

    Example:
        >>> check_balance([1, 3], 4, 2)
        [1, 3]
    """
    sizes = list(split)
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
        raise ConfigError(f"balance={sizes} is invalid; valid: ints >= 1 (layers per stage)")
    if len(sizes) != num_stages:
        raise ConfigError(
            f"balance={sizes} has {len(sizes)} stages; valid: {num_stages} entries (num_stages)"
        )
    if sum(sizes) != num_layers:
        raise ConfigError(
            f"balance={sizes} sums to {sum(sizes)} layers but the module has {num_layers}; "
            f"valid: entries summing to {num_layers}"
        )
    return sizes


def stage_bounds(split: Sequence[int]) -> list[tuple[int, int]]:
    """``[(start, stop), ...]``: the half-open layer range of each stage."""
    out, start = [], 0
    for size in split:
        out.append((start, start + size))
        start += size
    return out
