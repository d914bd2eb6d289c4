"""Readable pytest ids for table-driven tests (instead of ``args0``, ``kwargs1``, ...)."""

from __future__ import annotations

from collections.abc import Mapping


def flags_id(args: list[str]) -> str:
    """Command-line flags as an id: ``["--lr", "fast"]`` -> ``"lr=fast"``."""
    pairs = zip(args[::2], args[1::2], strict=True)
    return ",".join(f"{flag.removeprefix('--')}={value}" for flag, value in pairs)


def kwargs_id(kwargs: Mapping[str, object]) -> str:
    """Keyword arguments as an id: ``{"steps": -3, "lr": 0.0}`` -> ``"steps=-3,lr=0.0"``."""
    return ",".join(f"{key}={value}" for key, value in kwargs.items())
