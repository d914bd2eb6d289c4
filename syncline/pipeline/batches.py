"""Take a batch from the user's iterator and cut it into equal micro-batches, or fail clearly.

Every rank takes every batch (stage 0 needs the inputs, the last stage the targets) and
checks both, so a batch that cannot be split fails on every rank at the same call, before
any message is sent.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from syncline.errors import ConfigError


@dataclass(frozen=True)
class Batch:
    """One batch, cut into micro-batches (views, no copies).

    Attributes:
        index: global batch number (the step), counted from the pipeline's first batch.
        inputs: per micro-batch, stage 0's input.
        targets: per micro-batch, the last stage's target.
    """

    index: int
    inputs: tuple[torch.Tensor, ...]
    targets: tuple[torch.Tensor, ...]


def take_batch(batches: Iterator[Any], index: int, num_microbatches: int) -> Batch:
    """``next(batches)`` as :class:`Batch` number ``index``.

    Raises:
        StopIteration: the iterator is exhausted.
        ConfigError: not a pair of tensors with one leading batch size that
            ``num_microbatches`` divides; the message names the sizes.
    """
    batch = next(batches)
    if not isinstance(batch, tuple | list) or len(batch) != 2:
        raise ConfigError(f"a batch must be (inputs, targets), got {type(batch).__name__}")
    inputs, targets = batch
    if not isinstance(inputs, torch.Tensor) or not isinstance(targets, torch.Tensor):
        raise ConfigError("a batch must be a pair of tensors (inputs, targets)")
    n = inputs.shape[0] if inputs.dim() else 0
    if inputs.dim() == 0 or targets.dim() == 0 or targets.shape[0] != n:
        raise ConfigError(
            f"inputs {tuple(inputs.shape)} and targets {tuple(targets.shape)} must share a "
            "leading batch dimension"
        )
    m = num_microbatches
    if n == 0 or n % m:
        raise ConfigError(
            f"batch {index} has {n} samples, which does not split into num_microbatches={m} "
            f"equal micro-batches; valid: a multiple of {m}"
        )
    size = n // m
    return Batch(index, inputs.split(size), targets.split(size))
