"""PURE: what typed config dataclasses share: value checks and documentation read from source.

Each setting is documented once, by a docstring directly under its field (as torchtitan's
configs are); :func:`field_docs` reads those docstrings back so that the command line's help
is generated from them and cannot drift from the code. :func:`option` attaches what only the
command line needs (flag spelling, group, metavar) to a field.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import itertools
import math
import textwrap
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from syncline.errors import ConfigError

__all__ = [
    "CLI",
    "Leaf",
    "check_float",
    "check_int",
    "field_docs",
    "flatten",
    "from_flat",
    "leaves",
    "option",
    "part",
    "part_type",
]

#: key of a field's ``metadata`` under which :func:`option` stores its :class:`CLI` entry
CLI = "syncline.cli"
_T = TypeVar("_T")
_U = TypeVar("_U")
#: key of a field's ``metadata`` under which :func:`part` stores the part's config class
PART = "syncline.part"


@dataclasses.dataclass(frozen=True)
class CliOption:
    """How a config field appears on the command line (everything else comes from the field).

    Attributes:
        group: the ``--help`` section it is listed in.
        flags: its spellings; default ``--field-name``.
        metavar: the placeholder shown in ``--help``.
        choices: a callable giving the valid names (read when the parser is built, so that
            registered plug-ins appear too); shown in the help, checked by the config.
        help_from: a config class whose field of the same name documents this one.
        hidden: not on the command line (set from other options or internally).
        parse: turns the text into the field's value (default: from the field's type).
        default_text: what ``--help`` says when the default is ``None``.
        listed_after: the (flat) name of the field this one follows in ``--help``, for a
            field listed among another owner's fields (e.g. ``timeout_s``, the run's, among
            data parallelism's); by default fields are listed in declaration order.
    """

    group: str = "options"
    flags: tuple[str, ...] = ()
    metavar: str | None = None
    choices: Callable[[], Iterable[str]] | None = None
    help_from: type | None = None
    hidden: bool = False
    parse: Callable[[str], Any] | None = None
    default_text: str | None = None
    listed_after: str | None = None


def option(
    default: Any = dataclasses.MISSING,
    *,
    default_factory: Any = dataclasses.MISSING,
    **cli: Any,
) -> Any:
    """A dataclass field with its command-line presentation (see :class:`CliOption`)."""
    meta = {CLI: CliOption(**cli)}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def cli_option(f: dataclasses.Field[Any]) -> CliOption:
    """The :class:`CliOption` of a field (defaults when it was declared without one)."""
    found = f.metadata.get(CLI)
    return found if isinstance(found, CliOption) else CliOption()


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring written directly under each field of a dataclass, by field name.

    Fields of base classes come first; a field without a docstring is absent. Reads the
    class's source, so it needs the ``.py`` file (always present for syncline's configs).
    """
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__[:-1]):
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body[0]
        if not isinstance(body, ast.ClassDef):
            continue
        stmts = body.body
        for stmt, nxt in itertools.pairwise(stmts):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[stmt.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def part(cls: type) -> Any:
    """A field holding a whole config dataclass ``cls`` (default: ``cls()``), composed into a
    larger config: its fields keep their own names, documentation and checks, and
    :func:`leaves`, :func:`from_flat` and :func:`flatten` see through it."""
    return dataclasses.field(default_factory=cls, metadata={PART: cls})


def part_type(f: dataclasses.Field[Any]) -> type | None:
    """The config class of a field declared with :func:`part`, else ``None``."""
    found = f.metadata.get(PART)
    return found if isinstance(found, type) else None


@dataclasses.dataclass(frozen=True)
class Leaf:
    """A setting of a composed config: a field that is not itself a :func:`part`.

    Attributes:
        path: the attributes leading to it, e.g. ``("optim", "lr")`` for ``cfg.optim.lr``.
        owner: the dataclass that declares (and documents) it.
        field: the field itself.
    """

    path: tuple[str, ...]
    owner: type
    field: dataclasses.Field[Any]

    @property
    def name(self) -> str:
        """Its flat name: the field's own (unique over the composed config)."""
        return self.path[-1]


def leaves(cls: type) -> tuple[Leaf, ...]:
    """Every setting of the dataclass ``cls``, parts expanded in place, in declaration order.

    Raises:
        TypeError: two settings share a name (a flat name must say which one it is).
    """
    return _leaves(cls)


@functools.cache
def _leaves(cls: type) -> tuple[Leaf, ...]:
    found: list[Leaf] = []

    def walk(klass: type, path: tuple[str, ...]) -> None:
        for f in dataclasses.fields(klass):
            sub = part_type(f)
            if sub is None:
                found.append(Leaf((*path, f.name), klass, f))
            else:
                walk(sub, (*path, f.name))

    walk(cls, ())
    names = [leaf.name for leaf in found]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise TypeError(f"{cls.__name__}: settings {twice} are declared in more than one part")
    return tuple(found)


def from_flat(cls: type[_T], values: Mapping[str, Any]) -> _T:
    """``cls`` built from settings by flat name, each part from its own (the others keep
    their defaults); the parts check their values as they are created, then ``cls``.

    Raises:
        ConfigError: a name that is no setting of ``cls``, naming the valid ones.
    """
    known = {leaf.name for leaf in leaves(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown config keys {unknown}; valid: {sorted(known)}")

    def build(klass: type[_U]) -> _U:
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(klass):  # type: ignore[arg-type]
            sub = part_type(f)
            if sub is not None:
                kwargs[f.name] = build(sub)
            elif f.name in values:
                kwargs[f.name] = values[f.name]
        return klass(**kwargs)

    return build(cls)


def flatten(cls: type, data: Mapping[str, Any]) -> dict[str, Any]:
    """A config of ``cls`` as saved (parts nested as objects, or every setting at the top as
    older versions saved it, or a mix) as one dict by flat name; no value is checked.

    Raises:
        ConfigError: a setting given twice (at the top and in its part).
    """
    parts = {f.name: sub for f in dataclasses.fields(cls) if (sub := part_type(f)) is not None}
    out: dict[str, Any] = {}
    for key, value in data.items():
        sub = parts.get(key)
        inner = flatten(sub, value) if sub is not None and isinstance(value, Mapping) else None
        for name, item in (inner or {key: value}).items():
            if name in out:
                raise ConfigError(f"config key {name!r} is given twice; give it once")
            out[name] = item
    return out


def _bound(value: float) -> str:
    return f"{value:g}"


def check_int(name: str, value: object, *, low: int = 1, high: int | None = None) -> int:
    """``value`` if it is an ``int`` in ``[low, high]`` (no upper bound without ``high``).

    Raises:
        ConfigError: ``{name}={value!r} is invalid; valid: an integer >= 1`` (or ``in [low,
            high]``); a ``bool`` is no integer here.

    Example:
        >>> check_int("steps", 0)
        Traceback (most recent call last):
        ...
        syncline.errors.ConfigError: steps=0 is invalid; valid: an integer >= 1
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < low
        or (high is not None and value > high)
    ):
        valid = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ConfigError(f"{name}={value!r} is invalid; valid: an integer {valid}")
    return value


def check_float(
    name: str,
    value: object,
    *,
    above: float | None = None,
    at_least: float | None = None,
    below: float | None = None,
    at_most: float | None = None,
    finite: bool = True,
) -> float:
    """``value`` if it is a number (``int`` or ``float``, no ``bool``, no NaN) within the
    bounds given, and finite unless ``finite=False`` (NaN and infinity pass a plain ``> 0``
    check one way or the other, and would fail later, inside the run).

    Raises:
        ConfigError: ``{name}={value!r} is invalid; valid: a finite number > 0`` (or ``a
            number in [0, 1)``, ...), in the one form of :func:`check_int`.

    Example:
        >>> check_float("momentum", 1.0, at_least=0, below=1)
        Traceback (most recent call last):
        ...
        syncline.errors.ConfigError: momentum=1.0 is invalid; valid: a number in [0, 1)
    """
    low = above if above is not None else at_least
    high = below if below is not None else at_most
    ok = not isinstance(value, bool) and isinstance(value, int | float) and value == value
    if ok:
        number: float = value  # type: ignore[assignment]
        ok = (
            (above is None or number > above)
            and (at_least is None or number >= at_least)
            and (below is None or number < below)
            and (at_most is None or number <= at_most)
            and (not finite or not isinstance(number, float) or math.isfinite(number))
        )
    if not ok:
        if low is not None and high is not None:
            left, right = "(" if above is not None else "[", ")" if below is not None else "]"
            valid = f"a number in {left}{_bound(low)}, {_bound(high)}{right}"
        else:
            kind = "a finite number" if finite else "a number"
            if low is not None:
                valid = f"{kind} {'>' if above is not None else '>='} {_bound(low)}"
            elif high is not None:
                valid = f"{kind} {'<' if below is not None else '<='} {_bound(high)}"
            else:
                valid = kind
        raise ConfigError(f"{name}={value!r} is invalid; valid: {valid}")
    return value  # type: ignore[return-value]
