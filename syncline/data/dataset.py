"""The batched-gather dataset protocol that the samplers draw from, and a tensor-pair dataset."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from syncline.errors import ConfigError

__all__ = ["IndexedDataset", "TensorPairDataset"]


@runtime_checkable
class IndexedDataset(Protocol):
    """A finite data set that gathers a whole batch at once.

    ``get`` takes a 1-D LongTensor of indices in ``[0, len(self))`` and returns the inputs
    and targets for them, stacked along a new first dimension, in the order given.
    """

    def __len__(self) -> int: ...

    def get(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


class TensorPairDataset:
    """Inputs and targets held as two tensors with the same first dimension.

    Example:
        >>> ds = TensorPairDataset(torch.zeros(5, 1, 8, 8), torch.arange(5))
        >>> x, y = ds.get(torch.tensor([4, 0]))
        >>> x.shape, y.tolist()
        (torch.Size([2, 1, 8, 8]), [4, 0])
    """

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        if inputs.dim() == 0 or targets.dim() == 0 or len(inputs) != len(targets):
            raise ConfigError(
                f"inputs of shape {tuple(inputs.shape)} and targets of shape "
                f"{tuple(targets.shape)} do not match; valid: the same non-zero first dimension"
            )
        if len(inputs) == 0:
            raise ConfigError("TensorPairDataset got 0 samples; valid: at least 1")
        self.inputs = inputs
        self.targets = targets

    def __len__(self) -> int:
        return len(self.inputs)

    def get(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather ``(inputs[indices], targets[indices])`` in one indexing op each."""
        return self.inputs[indices], self.targets[indices]
