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
from syncline.fields import check_int


@dataclass(frozen=True)
class Bucket:
    """A contiguous range ``[start, end)`` (in elements) of flat buffer ``flat``."""

    index: int
    start: int
    end: int
    params: tuple[int, ...]
    flat: int = 0

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class BucketPlan:
    """Where each parameter lives in the flat buffers, and the buckets over them.

    One flat buffer per gradient dtype (``kinds``): a bucket is one slice of one buffer, so
    parameters of several dtypes never share a bucket (as DDP buckets per dtype).

    Attributes:
        offsets: ``offsets[i]`` is parameter ``i``'s first element in its flat buffer.
        numels: ``numels[i]`` is parameter ``i``'s element count.
        order: parameter indices in layout (expected-ready) order.
        buckets: in launch order; within one flat buffer, each bucket covers the range
            right after the previous one of that buffer.
        bucket_of: ``bucket_of[i]`` is the bucket holding parameter ``i``.
        kinds: ``kinds[i]`` is the flat buffer parameter ``i`` lives in.
        flat_numels: the element count of each flat buffer.
    """

    offsets: tuple[int, ...]
    numels: tuple[int, ...]
    order: tuple[int, ...]
    buckets: tuple[Bucket, ...]
    bucket_of: tuple[int, ...]
    kinds: tuple[int, ...] = ()
    flat_numels: tuple[int, ...] = ()

    @property
    def total_numel(self) -> int:
        return sum(self.flat_numels)


def plan_buckets(
    numels: Sequence[int],
    order: Sequence[int],
    element_size: int | Sequence[int],
    cap_bytes: int,
    first_cap_bytes: int | None = None,
    kinds: Sequence[int] | None = None,
) -> BucketPlan:
    """Plan the flat layout and its buckets.

    Args:
        numels: element count of each parameter, indexed by parameter.
        order: a permutation of ``range(len(numels))``: the order gradients are expected to
            become ready (for a first guess, reverse registration order).
        element_size: bytes per element of the gradient dtype (one per kind with ``kinds``).
        cap_bytes: a bucket is closed once it holds at least this many bytes.
        first_cap_bytes: cap for the first bucket only (``None``: same as ``cap_bytes``).
        kinds: which flat buffer each parameter lives in (one per gradient dtype, numbered
            from 0); ``None``: all in one. Each kind fills its own open bucket in ``order``;
            buckets launch in the order they close, the still-open ones last in the order of
            their first parameter.

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
    kind_of = [0] * n if kinds is None else list(kinds)
    if len(kind_of) != n:
        raise ConfigError(f"kinds has {len(kind_of)} entries for {n} parameters")
    sizes = [element_size] if isinstance(element_size, int) else list(element_size)
    if any(k < 0 or k >= len(sizes) for k in kind_of):
        raise ConfigError(f"kinds={kind_of} must index element_size={sizes}")
    for size in sizes:
        check_int("element_size", size)
    check_int("cap_bytes", cap_bytes)
    first = check_int("first_cap_bytes", cap_bytes if first_cap_bytes is None else first_cap_bytes)

    offsets = [0] * n
    cursor = [0] * len(sizes)
    start = [0] * len(sizes)
    members: list[list[int]] = [[] for _ in sizes]
    closed: list[tuple[int, int, int, tuple[int, ...]]] = []  # (kind, start, end, params)
    for i in order:
        k = kind_of[i]
        offsets[i] = cursor[k]
        cursor[k] += numels[i]
        members[k].append(i)
        cap = first if not closed else cap_bytes
        if (cursor[k] - start[k]) * sizes[k] >= cap:
            closed.append((k, start[k], cursor[k], tuple(members[k])))
            members[k], start[k] = [], cursor[k]
    position = {i: at for at, i in enumerate(order)}
    still_open = sorted(
        (k for k in range(len(sizes)) if members[k]), key=lambda k: position[members[k][0]]
    )
    closed += [(k, start[k], cursor[k], tuple(members[k])) for k in still_open]
    buckets = tuple(Bucket(b, lo, hi, ps, k) for b, (k, lo, hi, ps) in enumerate(closed))
    bucket_of = [0] * n
    for b in buckets:
        for i in b.params:
            bucket_of[i] = b.index
    return BucketPlan(
        tuple(offsets),
        tuple(numels),
        tuple(order),
        buckets,
        tuple(bucket_of),
        tuple(kind_of),
        tuple(cursor),
    )
