"""PURE: lay gradients out in one flat buffer and cut it into allreduce buckets.

Lazy allreduce (GradientFlow, Sun et al. 2019; Horovod's tensor fusion): gradients sit in one
contiguous buffer in the order backward produces them, so every bucket is a contiguous range
and one collective covers it. The first bucket is kept small (DDP uses 1 MiB) so communication
starts early in backward; the rest are cut once they reach ``cap_bytes``.

Example:
    >>> plan = plan_buckets([4, 4, 4], order=[2, 1, 0], element_size=4, cap_bytes=32)
    >>> [(b.start, b.end, b.params) for b in plan.buckets]
    [(0, 8, (2, 1)), (8, 12, (0,))]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from syncline.errors import ConfigError


@dataclass(frozen=True)
class Bucket:
    """A contiguous range ``[start, end)`` of the flat buffer (in elements)."""

    index: int
    start: int
    end: int
    params: tuple[int, ...]

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class BucketPlan:
    """Where each parameter lives in the flat buffer, and the buckets over it.

    Attributes:
        offsets: ``offsets[i]`` is parameter ``i``'s first element in the flat buffer.
        numels: ``numels[i]`` is parameter ``i``'s element count.
        order: parameter indices in layout (expected-ready) order.
        buckets: in launch order; bucket ``k`` covers the range right after bucket ``k-1``.
        bucket_of: ``bucket_of[i]`` is the bucket holding parameter ``i``.
    """

    offsets: tuple[int, ...]
    numels: tuple[int, ...]
    order: tuple[int, ...]
    buckets: tuple[Bucket, ...]
    bucket_of: tuple[int, ...]

    @property
    def total_numel(self) -> int:
        return self.buckets[-1].end if self.buckets else 0


def plan_buckets(
    numels: Sequence[int],
    order: Sequence[int],
    element_size: int,
    cap_bytes: int,
    first_cap_bytes: int | None = None,
) -> BucketPlan:
    """Plan the flat layout and its buckets.

    Args:
        numels: element count of each parameter, indexed by parameter.
        order: a permutation of ``range(len(numels))``: the order gradients are expected to
            become ready (for a first guess, reverse registration order).
        element_size: bytes per element of the gradient dtype.
        cap_bytes: a bucket is closed once it holds at least this many bytes.
        first_cap_bytes: cap for the first bucket only (``None``: same as ``cap_bytes``).

    Returns:
        The plan; a parameter is never split across buckets.

    Raises:
        ConfigError: on non-positive sizes or an ``order`` that is not a permutation.
    """
    n = len(numels)
    if sorted(order) != list(range(n)):
        raise ConfigError(f"order={list(order)} must be a permutation of range({n})")
    if any(k <= 0 for k in numels):
        raise ConfigError(f"every parameter needs numel > 0, got {list(numels)}")
    if element_size <= 0 or cap_bytes <= 0:
        raise ConfigError(
            f"element_size={element_size} and cap_bytes={cap_bytes} must both be positive"
        )
    first = cap_bytes if first_cap_bytes is None else first_cap_bytes
    if first <= 0:
        raise ConfigError(f"first_cap_bytes={first_cap_bytes} must be positive")

    offsets = [0] * n
    bucket_of = [0] * n
    buckets: list[Bucket] = []
    members: list[int] = []
    start = cursor = 0
    for i in order:
        offsets[i] = cursor
        cursor += numels[i]
        members.append(i)
        cap = first if not buckets else cap_bytes
        if (cursor - start) * element_size >= cap:
            buckets.append(Bucket(len(buckets), start, cursor, tuple(members)))
            members, start = [], cursor
    if members:
        buckets.append(Bucket(len(buckets), start, cursor, tuple(members)))
    for b in buckets:
        for i in b.params:
            bucket_of[i] = b.index
    return BucketPlan(tuple(offsets), tuple(numels), tuple(order), tuple(buckets), tuple(bucket_of))
