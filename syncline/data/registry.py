"""PURE: the data-set registry: what ``--data NAME`` builds, for the models that name it.

An entry's ``build(seq_len, seed)`` returns a map-style data set of ``(input, target)``
pairs and the number of tokens per sample (1 for images); :mod:`syncline.data.sampler`
shards it over ranks deterministically. Adding a data set is one builder plus one
``DATASETS.register(DatasetSpec(...))``, and a model lists it in its ``datasets``.

An entry may take an argument, ``--data NAME:ARGUMENT``: ``text:PATH`` (a text file or a
folder of them, as bytes) and ``images:PATH`` (a folder of class sub-folders, as
torchvision's ``ImageFolder``). Any other ``package.module:function`` is the user's own
factory of a map-style data set (:mod:`syncline.data.user`). :func:`check_data` runs an
entry's checks of its argument (paths, emptiness, readability), which ``syncline train``
does before any process starts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from syncline.errors import ConfigError
from syncline.extras import require
from syncline.registry import REFERENCE, Registry, check_reference, resolve

__all__ = [
    "DATASETS",
    "FACTORY",
    "DatasetSpec",
    "build_dataset",
    "check_data",
    "check_fits",
    "data_choices",
    "data_forms",
    "data_spec",
]


@dataclass(frozen=True)
class DatasetSpec:
    """One data set.

    Attributes:
        name: what ``--data`` takes.
        summary: one line for ``--help``.
        build: ``(seq_len, seed) -> (dataset, tokens per sample)`` or ``"module:function"``;
            with an ``argument``: ``(seq_len, seed, argument)``.
        argument: what follows ``NAME:`` (e.g. ``"PATH"``, shown in ``--help``); ``None``:
            the entry takes none.
        check: ``(argument, seq_len, val_fraction) -> None`` (or ``"module:function"``),
            raising ``ConfigError`` for a bad argument; run before any process starts.
        needs: the import name of the optional package (an extra of
            :data:`syncline.extras.EXTRAS`) the entry reads with, checked first.
    """

    name: str
    summary: str
    build: str | Callable[..., tuple[Any, int]]
    argument: str | None = None
    check: str | Callable[[str, int, float], None] | None = None
    needs: str | None = None


DATASETS: Registry[DatasetSpec] = Registry("data")

#: ``--data package.module:function``: the user's own data set (never registered)
FACTORY = DatasetSpec(
    "factory",
    "a map-style data set of (input, target) pairs from your own function",
    "syncline.data.user:factory_dataset",
    argument=REFERENCE,
    check="syncline.data.user:check_factory",
)


def data_forms(names: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """How ``--data`` spells each entry of ``names`` (default: all), ``text:PATH`` for one
    that takes an argument, then the user's factory: for ``--help`` and messages."""
    entries = [DATASETS.get(n) for n in (DATASETS.names() if names is None else names)]
    forms = [f"{e.name}:{e.argument}" if e.argument else e.name for e in entries]
    return (*forms, REFERENCE)


def data_choices(names: tuple[str, ...] | None = None) -> str:
    """:func:`data_forms` as a phrase, for messages."""
    *named, factory = data_forms(names)
    return f"{', '.join(named)}, or your own factory as {factory}"


def check_fits(data: str | None, model: str, datasets: tuple[str, ...], any_data: bool) -> str:
    """The data set a model trains on: ``data``, or the model's first (``datasets[0]``).

    A model trains on the registered entries it lists, on the user's factory (``package.
    module:function``) whatever the model, and on anything when ``any_data`` (a factory's
    model, which has no default: it needs ``--data``).

    Raises:
        ConfigError: ``data`` does not fit the model, or is malformed (:func:`data_spec`).
    """
    if data is None:
        if not datasets:
            raise ConfigError(f"model={model!r} needs --data; valid: {data_choices()}")
        data = datasets[0]
    name = data.partition(":")[0]
    if not any_data and name not in datasets and (name in DATASETS or ":" not in data):
        raise ConfigError(
            f"data={data!r} does not fit model {model!r}; valid: {data_choices(datasets)}"
        )
    data_spec(data)
    return data


def data_spec(value: str) -> tuple[DatasetSpec, str | None]:
    """The entry ``--data value`` names and its argument (``None``: it takes none).

    ``NAME`` is a registered entry, ``NAME:ARGUMENT`` one that takes an argument, and any
    other ``package.module:function`` the user's factory (:data:`FACTORY`, whose argument
    is the whole reference). Only the form is checked; nothing is read or imported.

    Raises:
        ConfigError: an unknown name, a missing or unexpected argument, naming the valid ones.
    """
    name, sep, argument = value.partition(":")
    if name in DATASETS:
        entry = DATASETS.get(name)
        if entry.argument is None and sep:
            raise ConfigError(f"data={value!r}: {name!r} takes no argument; valid: {name}")
        if entry.argument is not None and not argument.strip():
            raise ConfigError(
                f"data={value!r} needs its {entry.argument}; valid: {name}:{entry.argument}"
            )
        return entry, (argument if sep else None)
    if sep:
        try:
            check_reference("data", value)
        except ConfigError:
            pass
        else:
            return FACTORY, value
    raise ConfigError(f"data={value!r} is unknown; valid: {data_choices()}")


def build_dataset(name: str, seq_len: int, seed: int) -> tuple[Any, int]:
    """The data set ``--data name`` names (see :func:`data_spec`) and its tokens per sample.

    Raises:
        ConfigError: an unknown name, listing the valid ones; what the builder raises.
    """
    entry, argument = data_spec(name)
    build = resolve(entry.build)
    built: tuple[Any, int] = (
        build(seq_len, seed) if entry.argument is None else build(seq_len, seed, argument)
    )
    return built


def check_data(value: str, seq_len: int, val_fraction: float) -> None:
    """The checks of ``--data value`` that read files or import code, so that a bad path,
    an empty folder, unreadable data or a failing factory stop before any process starts.

    Raises:
        ConfigError: one line naming the value and what is valid.
    """
    entry, argument = data_spec(value)
    if entry.needs is not None:
        require(f"--data {value}", entry.needs)
    if entry.check is not None and argument is not None:
        resolve(entry.check)(argument, seq_len, val_fraction)


_B = "syncline.data.builtin"
DATASETS.register(
    DatasetSpec("stdlib", "the Python standard library's own source, as bytes", f"{_B}:stdlib")
)
DATASETS.register(
    DatasetSpec(
        "digits",
        "scikit-learn's 8x8 hand-written digits (1797 images)",
        f"{_B}:digits",
        needs="sklearn",
    )
)
DATASETS.register(
    DatasetSpec("synthetic", "4096 random 8x8 images of 10 learnable classes", f"{_B}:synthetic")
)
DATASETS.register(
    DatasetSpec(
        "text",
        "a text file, or a folder of them (read in sorted order), as bytes",
        "syncline.data.folders:text_folder",
        argument="PATH",
        check="syncline.data.files:check_text",
    )
)
DATASETS.register(
    DatasetSpec(
        "tokens",
        "a text file or folder as token ids of a tokenizers JSON (e.g. HF tokenizer.json)",
        "syncline.data.folders:token_folder",
        argument="TOKENIZER:PATH",
        check="syncline.data.files:check_tokens",
        needs="tokenizers",
    )
)
DATASETS.register(
    DatasetSpec(
        "images",
        "a folder of class sub-folders of images, as torchvision's ImageFolder",
        "syncline.data.folders:image_folder",
        argument="PATH",
        check="syncline.data.files:check_images",
        needs="PIL",
    )
)
