"""Hold out the end of a data set for validation, so that no validation sample is trained on."""

from __future__ import annotations

from typing import Any

import torch

from syncline.errors import ConfigError

__all__ = ["IndexRange", "holdout"]


class IndexRange:
    """Samples ``[start, stop)`` of an indexed data set, renumbered from 0.

    Example:
        >>> from syncline.data.dataset import TensorPairDataset
        >>> tail = IndexRange(TensorPairDataset(torch.arange(10), torch.arange(10)), 8, 10)
        >>> len(tail), tail.get(torch.tensor([1, 0]))[0].tolist()
        (2, [9, 8])
    """

    def __init__(self, dataset: Any, start: int, stop: int) -> None:
        if not 0 <= start < stop <= len(dataset):
            raise ConfigError(
                f"samples [{start}, {stop}) are not a non-empty range of the data set's "
                f"{len(dataset)}"
            )
        self.dataset, self.start, self.stop = dataset, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def get(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pair: tuple[torch.Tensor, torch.Tensor] = self.dataset.get(indices + self.start)
        return pair


def holdout(dataset: Any, fraction: float) -> tuple[Any, Any | None]:
    """``(train, validation)`` parts of ``dataset``; ``fraction`` 0 holds nothing out.

    A data set with its own ``split(fraction)`` cuts itself (a text cuts its token stream, so
    no window straddles the cut); any other gives its last ``fraction`` of samples.

    Raises:
        ConfigError: a fraction outside [0, 1), or one that leaves a part empty.
    """
    if isinstance(fraction, bool) or not isinstance(fraction, int | float):
        raise ConfigError(f"val_fraction={fraction!r} is invalid; valid: a number in [0, 1)")
    if not 0.0 <= fraction < 1.0:
        raise ConfigError(f"val_fraction={fraction!r} is invalid; valid: 0 <= f < 1")
    if fraction == 0:
        return dataset, None
    split = getattr(dataset, "split", None)
    if callable(split):
        train, val = split(fraction)
        return train, val
    n = len(dataset)
    n_val = round(n * fraction)
    if n_val < 1 or n_val >= n:
        raise ConfigError(
            f"val_fraction={fraction} of {n} samples holds out {n_val}; valid: a fraction "
            "that leaves at least one sample on each side"
        )
    return IndexRange(dataset, 0, n - n_val), IndexRange(dataset, n - n_val, n)
