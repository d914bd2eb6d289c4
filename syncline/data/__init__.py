"""Reference data sets and deterministic rank-aware batching; nothing is read at import."""

from __future__ import annotations

from syncline.data.dataset import IndexedDataset, TensorPairDataset
from syncline.data.images import digits_dataset, synthetic_images
from syncline.data.sampler import ShardedBatches, step_seed
from syncline.data.text import ByteDataset, stdlib_corpus, stdlib_files

__all__ = [
    "ByteDataset",
    "IndexedDataset",
    "ShardedBatches",
    "TensorPairDataset",
    "digits_dataset",
    "stdlib_corpus",
    "stdlib_files",
    "step_seed",
    "synthetic_images",
]
