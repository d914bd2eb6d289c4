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
from collections.abc import Callable, Iterable
from typing import Any

from syncline.errors import ConfigError

__all__ = [
    "CLI",
    "check_positive",
    "check_positive_int",
    "field_docs",
    "option",
]

#: key of a field's ``metadata`` under which :func:`option` stores its :class:`CLI` entry
CLI = "syncline.cli"


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
    """

    group: str = "options"
    flags: tuple[str, ...] = ()
    metavar: str | None = None
    choices: Callable[[], Iterable[str]] | None = None
    help_from: type | None = None
    hidden: bool = False
    parse: Callable[[str], Any] | None = None
    default_text: str | None = None


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


def check_positive(name: str, value: object) -> None:
    """Raise :class:`ConfigError` unless ``value`` is a finite number > 0 (NaN and infinity
    pass a plain ``> 0`` check one way or the other, and fail later, inside the run)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ConfigError(f"{name}={value!r} must be a finite number > 0")


def check_positive_int(name: str, value: object) -> None:
    """Raise :class:`ConfigError` unless ``value`` is an ``int`` >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name}={value!r} must be a positive integer")
