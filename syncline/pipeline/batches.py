"""Take a batch from the user's iterator and cut it into equal micro-batches, or fail clearly.

Every rank takes every batch (stage 0 needs the inputs, the last stage the targets) and
checks both, so a batch that cannot be split fails on every rank at the same call, before
any message is sent.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from syncline.errors import ConfigError

Inputs = torch.Tensor | Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class Batch:
    """One batch, cut into micro-batches (views, no copies).

    Attributes:
        index: global batch number (the step), counted from the pipeline's first batch.
        inputs: per micro-batch, stage 0's input (a traced model: its inputs by name).
        targets: per micro-batch, the last stage's target.
    """

    index: int
    inputs: tuple[Inputs, ...]
    targets: tuple[torch.Tensor, ...]


def leading_size(inputs: object) -> int | None:
    """The batch size of a tensor, or of a mapping of tensors that agree on it (else None)."""
    if isinstance(inputs, torch.Tensor):
        return inputs.shape[0] if inputs.dim() else None
    if isinstance(inputs, Mapping) and inputs:
        values = list(inputs.values())
        if not all(isinstance(v, torch.Tensor) and v.dim() for v in values):
            return None
        sizes = {v.shape[0] for v in values}
        return sizes.pop() if len(sizes) == 1 else None
    return None


def split_inputs(inputs: Inputs, size: int) -> tuple[Inputs, ...]:
    """``inputs`` cut along the batch dimension into parts of ``size`` (views)."""
    if isinstance(inputs, torch.Tensor):
        return inputs.split(size)
    parts = {k: v.split(size) for k, v in inputs.items()}
    count = len(next(iter(parts.values())))
    return tuple({k: v[i] for k, v in parts.items()} for i in range(count))


def to_device(inputs: Inputs, device: torch.device) -> Inputs:
    if isinstance(inputs, torch.Tensor):
        return inputs.to(device)
    return {k: v.to(device) for k, v in inputs.items()}


def take_batch(batches: Iterator[Any], index: int, num_microbatches: int) -> Batch:
    """``next(batches)`` as :class:`Batch` number ``index``.

    Raises:
        StopIteration: the iterator is exhausted.
        ConfigError: not a pair (inputs, targets) of a tensor (or a mapping of tensors by
            input name) and a tensor with one leading batch size that ``num_microbatches``
            divides; the message names the sizes.
    """
    batch = next(batches)
    if not isinstance(batch, tuple | list) or len(batch) != 2:
        raise ConfigError(f"a batch must be (inputs, targets), got {type(batch).__name__}")
    inputs, targets = batch
    if not isinstance(inputs, torch.Tensor | Mapping) or not isinstance(targets, torch.Tensor):
        raise ConfigError(
            "a batch must be a pair (inputs, targets) of tensors (inputs may also be a dict "
            "of tensors by the model's argument names)"
        )
    n = leading_size(inputs)
    if n is None or targets.dim() == 0 or targets.shape[0] != n:
        shape = (
            tuple(inputs.shape)
            if isinstance(inputs, torch.Tensor)
            else {k: tuple(getattr(v, "shape", ())) for k, v in inputs.items()}
        )
        raise ConfigError(
            f"inputs {shape} and targets {tuple(targets.shape)} must share a "
            "leading batch dimension"
        )
    m = num_microbatches
    if n == 0 or n % m:
        raise ConfigError(
            f"batch {index} has {n} samples, which does not split into num_microbatches={m} "
            f"equal micro-batches; valid: a multiple of {m}"
        )
    size = n // m
    return Batch(index, split_inputs(inputs, size), targets.split(size))
