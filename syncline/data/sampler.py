"""Rank-aware deterministic batching: every rank derives the same global batch on its own.

The indices of step ``s`` are drawn from a generator seeded by a hash of ``(seed, s)``, so
any rank can build any step's batch without communication, a resumed run needs only the
step number, and the global batch does not depend on the world size::

    global batch of step s:  [ i0 i1 i2 i3 | i4 i5 i6 i7 ]      global_batch = 8
                               rank 0        rank 1           world_size = 2
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator

import torch

from syncline.data.dataset import IndexedDataset
from syncline.errors import ConfigError
from syncline.fields import check_int

__all__ = ["ShardedBatches", "step_seed"]


def step_seed(seed: int, step: int) -> int:
    """A 63-bit generator seed for one step: a hash of ``(seed, step)``.

    A hash rather than, say, ``seed * K + step`` so that nearby runs (seed 0 step 1 and
    seed 1 step 0) get unrelated streams.
    """
    digest = hashlib.blake2b(f"syncline/{seed}/{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class ShardedBatches:
    """This rank's share of a deterministic stream of global batches.

    Each step's global batch is ``global_batch`` indices drawn uniformly with replacement
    from ``[0, len(dataset))``; rank ``r`` gets the contiguous slice
    ``[r * B / W, (r + 1) * B / W)`` of them. Concatenating the ranks' batches in rank order
    therefore gives exactly the batch a single process (``world_size=1``) sees.

    Args:
        dataset: anything with ``__len__`` and a batched ``get(indices) -> (x, y)``.
        global_batch: samples per step summed over all ranks; a multiple of ``world_size``.
        rank: this process's index in ``[0, world_size)``.
        world_size: number of data-parallel ranks.
        seed: stream seed; ranks of one run must agree on it.

    Raises:
        ConfigError: for non-positive sizes, a rank out of range, a global batch that
            ``world_size`` does not divide, or an empty data set.

    Example:
        >>> from syncline.data.dataset import TensorPairDataset
        >>> ds = TensorPairDataset(torch.arange(100), torch.arange(100))
        >>> halves = [ShardedBatches(ds, 8, r, 2, seed=0).batch(3)[0] for r in (0, 1)]
        >>> whole = ShardedBatches(ds, 8, 0, 1, seed=0).batch(3)[0]
        >>> bool(torch.equal(torch.cat(halves), whole))
        True
    """

    def __init__(
        self,
        dataset: IndexedDataset,
        global_batch: int,
        rank: int,
        world_size: int,
        seed: int = 0,
    ) -> None:
        check_int("global_batch", global_batch)
        check_int("world_size", world_size)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ConfigError(
                f"rank={rank!r} is invalid for world_size={world_size}; "
                f"valid: 0 <= rank < {world_size}"
            )
        if global_batch % world_size != 0:
            raise ConfigError(
                f"global_batch={global_batch} is not divisible by world_size={world_size}; "
                f"valid: a multiple of {world_size}"
            )
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ConfigError(f"seed={seed!r} is invalid; valid: an int")
        if len(dataset) == 0:
            raise ConfigError("dataset has 0 samples; valid: at least 1")
        self.dataset = dataset
        self.global_batch_size = global_batch
        self.local_batch_size = global_batch // world_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed

    def global_indices(self, step: int) -> torch.Tensor:
        """The dataset indices of step ``step``'s whole global batch, LongTensor (B,)."""
        check_int("step", step, low=0)
        gen = torch.Generator().manual_seed(step_seed(self.seed, step))
        return torch.randint(len(self.dataset), (self.global_batch_size,), generator=gen)

    def indices(self, step: int) -> torch.Tensor:
        """This rank's slice of ``global_indices(step)``, LongTensor (B / W,)."""
        start = self.rank * self.local_batch_size
        return self.global_indices(step)[start : start + self.local_batch_size]

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``(x, y)`` for step ``step``; only its own samples are gathered."""
        return self.dataset.get(self.indices(step))

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole global ``(x, y)`` for step ``step``, as every rank would see it."""
        return self.dataset.get(self.global_indices(step))

    def batches(self, start_step: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's batches for steps ``start_step, start_step + 1, ...`` without end."""
        check_int("start_step", start_step, low=0)
        return (self.batch(step) for step in itertools.count(start_step))

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self.batches(0)
