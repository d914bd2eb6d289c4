"""Builders of the built-in data sets, as :mod:`syncline.data.registry` calls them."""

from __future__ import annotations

from syncline.data.dataset import TensorPairDataset
from syncline.data.images import digits_dataset, synthetic_images
from syncline.data.text import ByteDataset, stdlib_corpus

__all__ = ["digits", "stdlib", "synthetic"]


def stdlib(seq_len: int, seed: int) -> tuple[ByteDataset, int]:
    """Windows of ``seq_len`` bytes of the standard library's source (next-byte targets)."""
    del seed
    return ByteDataset(stdlib_corpus(), seq_len), seq_len


def digits(seq_len: int, seed: int) -> tuple[TensorPairDataset, int]:
    """scikit-learn's digits, standardised."""
    del seq_len, seed
    return TensorPairDataset(*digits_dataset()), 1


def synthetic(seq_len: int, seed: int) -> tuple[TensorPairDataset, int]:
    """Synthetic 8x8 images of 10 classes, drawn from ``seed``."""
    del seq_len
    return TensorPairDataset(*synthetic_images(4096, 8, 10, seed=seed)), 1
