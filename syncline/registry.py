"""PURE: a name -> entry table, one per extension point (compressors, schedules, models, ...).

Each extension point keeps one :class:`Registry` whose entries carry everything the rest of
syncline needs to know about them (a schedule's constraints, a model's loss and layer count),
so validation, the command line and the runtime read the entry and nobody hard-codes names.
Third-party code registers its own entries with ``register`` (from a module that
``syncline train --plugin MODULE`` imports in every process), without editing syncline.

Built-in entries may name their implementation as ``"package.module:attribute"`` strings,
resolved on first use by :func:`resolve`, so that a registry, and the configuration checks
that read it, can be imported without loading torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any, Generic, Protocol, TypeVar

from syncline.errors import ConfigError

__all__ = ["Named", "Registry", "import_plugins", "resolve"]


class Named(Protocol):
    @property
    def name(self) -> str: ...


E = TypeVar("E", bound=Named)


class Registry(Generic[E]):
    """Entries of one extension point by name; unknown names fail listing the valid ones.

    Example:
        >>> schedules = Registry("schedule")
        >>> schedules.register(spec)          # spec.name == "my-schedule"
        >>> schedules.get("my-schedule") is spec
        True
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, E] = {}

    def register(self, entry: E, *, replace: bool = False) -> E:
        """Add ``entry`` under ``entry.name``; returns it (usable as a decorator's result).

        Raises:
            ConfigError: the name is empty, has a ``:`` (reserved for specs' arguments) or
                is taken and ``replace`` is false.
        """
        name = entry.name
        if not name or ":" in name or name != name.strip():
            raise ConfigError(f"{self.kind} name {name!r} is invalid; valid: a word without ':'")
        if name in self._entries and not replace:
            raise ConfigError(
                f"{self.kind} {name!r} is already registered; pass replace=True to override it"
            )
        self._entries[name] = entry
        return entry

    def unregister(self, name: str) -> None:
        """Remove ``name`` (tests that register temporary entries clean up with this)."""
        self._entries.pop(name, None)

    def get(self, name: str) -> E:
        """The entry called ``name``.

        Raises:
            ConfigError: naming the unknown value and the valid ones.
        """
        try:
            return self._entries[name]
        except KeyError:
            raise ConfigError(
                f"{self.kind}={name!r} is unknown; valid: {', '.join(self.names())}"
            ) from None

    def names(self) -> tuple[str, ...]:
        """Registered names, in registration order (built-ins first)."""
        return tuple(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[E]:
        return iter(tuple(self._entries.values()))


def resolve(ref: Any) -> Any:
    """``ref`` itself, or the object a ``"package.module:attribute"`` string names.

    Raises:
        ConfigError: the module cannot be imported or has no such attribute.
    """
    if not isinstance(ref, str):
        return ref
    module, sep, attr = ref.partition(":")
    if not sep or not module or not attr:
        raise ConfigError(f"{ref!r} is not a reference; valid: 'package.module:attribute'")
    try:
        obj: Any = importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(f"cannot import {module!r} (from {ref!r}): {exc}") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(f"{module!r} has no attribute {attr!r} (from {ref!r})") from None
    return obj


def import_plugins(modules: tuple[str, ...] | list[str]) -> None:
    """Import each plug-in module, so that its ``register`` calls run in this process.

    Raises:
        ConfigError: naming the module that cannot be imported, and why.
    """
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigError(
                f"plugin={module!r} cannot be imported ({exc}); valid: an importable module "
                "on PYTHONPATH that registers syncline extensions"
            ) from None
