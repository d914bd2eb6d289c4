"""PURE: the data-set registry: what ``--data NAME`` builds, for the models that name it.

An entry's ``build(seq_len, seed)`` returns a map-style data set of ``(input, target)``
pairs and the number of tokens per sample (1 for images); :mod:`syncline.data.sampler`
shards it over ranks deterministically. Adding a data set is one builder plus one
``DATASETS.register(DatasetSpec(...))``, and a model lists it in its ``datasets``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from syncline.registry import Registry, resolve

__all__ = ["DATASETS", "DatasetSpec", "build_dataset"]


@dataclass(frozen=True)
class DatasetSpec:
    """One data set.

    Attributes:
        name: what ``--data`` takes.
        summary: one line for ``--help``.
        build: ``(seq_len, seed) -> (dataset, tokens per sample)`` or ``"module:function"``.
    """

    name: str
    summary: str
    build: str | Callable[[int, int], tuple[Any, int]]


DATASETS: Registry[DatasetSpec] = Registry("data")


def build_dataset(name: str, seq_len: int, seed: int) -> tuple[Any, int]:
    """The registered data set ``name`` and its tokens per sample.

    Raises:
        ConfigError: an unknown name, listing the valid ones.
    """
    built: tuple[Any, int] = resolve(DATASETS.get(name).build)(seq_len, seed)
    return built


_B = "syncline.data.builtin"
DATASETS.register(
    DatasetSpec("stdlib", "the Python standard library's own source, as bytes", f"{_B}:stdlib")
)
DATASETS.register(
    DatasetSpec("digits", "scikit-learn's 8x8 hand-written digits (1797 images)", f"{_B}:digits")
)
DATASETS.register(
    DatasetSpec("synthetic", "4096 random 8x8 images of 10 learnable classes", f"{_B}:synthetic")
)
