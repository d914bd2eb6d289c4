"""Data from the user's code: ``--data package.module:factory``, and inputs passed by name.

[Note: the data factory contract] ``factory()`` returns a map-style data set: ``len(ds)``
samples, ``ds[i] -> (input, target)`` (tensors, or what ``torch.as_tensor`` takes), the
same for the same ``i`` in every process; ``seq_len`` and ``seed`` are passed when the
factory names such parameters. The samplers draw indices of each step from the run's seed
(:mod:`syncline.data.sampler`), so sharding over ranks and replicas, and a resumed run, stay
exact as for the built-in sets. A data set with a batched ``get(indices) -> (inputs,
targets)`` is used as it is. The held-out part is its last ``val_fraction`` of samples,
unless it has a ``split(fraction) -> (train, val)`` of its own. Tokens per sample (for
tokens/s and perplexity): its ``tokens_per_sample`` attribute, else the number of elements
of an integer target (a class id: 1; a sequence of next tokens: its length), else 1.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from syncline.data.heldout import holdout
from syncline.data.registry import data_choices
from syncline.errors import ConfigError
from syncline.registry import call_factory, import_reference

__all__ = ["KeywordInputs", "MapDataset", "check_factory", "factory_dataset"]


class MapDataset:
    """A map-style data set of ``(input, target)`` samples, gathered a batch at a time.

    Example:
        >>> ds = MapDataset([(torch.tensor([1.0, 2.0]), 0), (torch.tensor([3.0, 4.0]), 1)])
        >>> x, y = ds.get(torch.tensor([1, 0]))
        >>> x.tolist(), y.tolist()
        ([[3.0, 4.0], [1.0, 2.0]], [1, 0])
    """

    def __init__(self, samples: Any) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def get(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = [self.samples[i] for i in indices.tolist()]
        inputs = torch.stack([torch.as_tensor(x) for x, _ in pairs])
        return inputs, torch.stack([torch.as_tensor(y) for _, y in pairs])


class KeywordInputs:
    """``dataset`` with its inputs passed by name, ``({name: inputs}, targets)``: how a
    model split at named modules is called (``model(**inputs)``, e.g. ``input_ids``)."""

    def __init__(self, dataset: Any, name: str) -> None:
        self.dataset, self.name = dataset, name

    def __len__(self) -> int:
        return len(self.dataset)

    def get(self, indices: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        inputs, targets = self.dataset.get(indices)
        return {self.name: inputs}, targets


def _tokens(dataset: Any) -> int:
    declared = getattr(dataset, "tokens_per_sample", None)
    if isinstance(declared, int) and declared >= 1:
        return declared
    _, target = dataset.get(torch.tensor([0]))
    return max(1, target[0].numel()) if not target.is_floating_point() else 1


def _import(ref: str) -> Any:
    """:func:`import_reference`; a top-level module that does not exist is reported as an
    unknown ``--data`` (``txt:PATH`` is more likely a misspelt entry than a factory)."""
    top = ref.partition(":")[0].split(".")[0]
    if importlib.util.find_spec(top) is None:
        raise ConfigError(
            f"data={ref!r} is unknown: no registered data set {top!r} and no module {top!r} "
            f"to import; valid: {data_choices()} (importable from the current directory or "
            "PYTHONPATH)"
        )
    return import_reference("data", ref)


def factory_dataset(seq_len: int, seed: int, ref: str) -> tuple[Any, int]:
    """The user's data set, ready to sample, and its tokens per sample (note above).

    Raises:
        ConfigError: the factory cannot be imported or fails, or what it returns is not a
            non-empty data set of ``(input, target)`` pairs.
    """
    factory = _import(ref)
    built = call_factory("data", ref, factory, {}, {"seq_len": seq_len, "seed": seed})
    if callable(getattr(built, "get", None)) and hasattr(built, "__len__"):
        dataset = built
    elif hasattr(built, "__len__") and hasattr(built, "__getitem__"):
        dataset = MapDataset(built)
    else:
        raise ConfigError(
            f"data={ref!r} returned a {type(built).__name__}; valid: a map-style data set "
            "(len(ds), ds[i] -> (input, target))"
        )
    if len(dataset) == 0:
        raise ConfigError(f"data={ref!r} returned an empty data set; valid: at least 1 sample")
    try:
        x, y = dataset.get(torch.tensor([0, len(dataset) - 1]))
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
            raise TypeError(f"got ({type(x).__name__}, {type(y).__name__})")
        tokens = _tokens(dataset)
    except Exception as exc:
        raise ConfigError(
            f"data={ref!r}: its samples are not (input, target) pairs of tensors of one "
            f"shape ({type(exc).__name__}: {' '.join(str(exc).split())}); valid: ds[i] -> "
            "(input, target)"
        ) from None
    return dataset, tokens


def check_factory(ref: str, seq_len: int, val_fraction: float) -> None:
    """Build the user's data set once before launch, and cut its held-out part.

    Raises:
        ConfigError: as :func:`factory_dataset`, or when ``val_fraction`` leaves a part empty.
    """
    dataset, _ = factory_dataset(seq_len, 0, ref)
    holdout(dataset, val_fraction)
