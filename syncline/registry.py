"""PURE: a name -> entry table, one per extension point (compressors, schedules, models, ...).

Each extension point keeps one :class:`Registry` whose entries carry everything the rest of
syncline needs to know about them (a schedule's constraints, a model's loss and layer count),
so validation, the command line and the runtime read the entry and nobody hard-codes names.
Third-party code registers its own entries with ``register`` (from a module that
``syncline train --plugin MODULE`` imports in every process), without editing syncline.

Built-in entries may name their implementation as ``"package.module:attribute"`` strings,
resolved on first use by :func:`resolve`, so that a registry, and the configuration checks
that read it, can be imported without loading torch. The user's own factories (``--model
package.module:factory``) go through :func:`import_reference` and :func:`call_factory`,
which turn every failure of the user's code into one line naming the value.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, Protocol, TypeVar

from syncline.errors import ConfigError

__all__ = [
    "REFERENCE",
    "Named",
    "Registry",
    "call_factory",
    "check_reference",
    "import_plugins",
    "import_reference",
    "resolve",
]


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


_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*\Z")
REFERENCE = "package.module:function"


def check_reference(what: str, text: str) -> tuple[str, str]:
    """``(module, attribute)`` of a ``"package.module:attribute"`` reference, checked for
    its form only (nothing is imported).

    Raises:
        ConfigError: naming ``what=text`` and the valid form.
    """
    module, _, attr = text.partition(":")
    if not (_DOTTED.match(module) and _DOTTED.match(attr)):
        raise ConfigError(
            f"{what}={text!r} is not a factory reference; valid: '{REFERENCE}' (dotted Python "
            "names; the module importable from the current directory or PYTHONPATH)"
        )
    return module, attr


def import_reference(what: str, text: str) -> Any:
    """The object a user's ``"package.module:attribute"`` names, importing its module.

    Unlike :func:`resolve` (for syncline's own references) any exception of the user's module
    at import (a syntax error, a missing dependency) becomes one line naming the value.

    Raises:
        ConfigError: a malformed reference, a module that fails to import, a missing
            attribute.
    """
    module, attr = check_reference(what, text)
    try:
        obj: Any = importlib.import_module(module)
    except Exception as exc:
        raise ConfigError(
            f"{what}={text!r}: cannot import module {module!r} ({type(exc).__name__}: "
            f"{_one_line(exc)}); valid: a module importable from the current directory or "
            "PYTHONPATH"
        ) from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = sorted(
                n for n, v in vars(obj).items()
                if callable(v) and not n.startswith("_") and not inspect.ismodule(v)
            )[:8]  # fmt: skip
            raise ConfigError(
                f"{what}={text!r}: {module!r} has no attribute {attr!r}; valid: one of its "
                f"functions or classes, e.g. {', '.join(public) or 'none found'}"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{what}={text!r} names a {type(obj).__name__}, not a function or class")
    return obj


def call_factory(
    what: str, text: str, factory: Callable[..., Any], options: Mapping[str, Any],
    offered: Mapping[str, Any],
) -> Any:  # fmt: skip
    """``factory(**options, **accepted)``: the user's keyword ``options`` (all must be
    parameters of the factory), and those of ``offered`` (e.g. ``seq_len``) that it names
    as parameters, so a factory declares only what it needs.

    Raises:
        ConfigError: an option the factory does not take (naming the ones it does), or any
            exception the factory raised, as one line.
    """
    params: Mapping[str, inspect.Parameter]
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin without a signature: offer nothing
        params = {}
    open_ended = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    unknown = sorted(k for k in options if k not in params and not open_ended)
    if unknown:
        raise ConfigError(
            f"{what}={text!r} takes no option {unknown[0]!r}; valid: {', '.join(params) or 'none'}"
        )
    kwargs = {k: v for k, v in offered.items() if k in params and k not in options}
    try:
        return factory(**options, **kwargs)
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(
            f"{what}={text!r} failed: {type(exc).__name__}: {_one_line(exc)}"
        ) from None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 300 else text[:297] + "..."
