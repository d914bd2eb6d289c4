"""Small pieces every benchmark needs: fair turn orders, paired ratios, merged JSON results.

[Note: turn-taking] A shared machine drifts (other processes, clock frequency), so engines
compared in one run take turns, and the order changes every turn: ``abba`` reverses it on odd
turns (A B, B A, A B, ...), so neither engine always runs first; ``rotated`` gives each of
many engines every position in turn. Ratios are best taken per turn (``paired_ratios``): the
two numbers compared ran next to each other, so slow drift cancels.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

__all__ = [
    "abba",
    "merge_results",
    "paired_ratios",
    "ratio",
    "ratio_of_medians",
    "read_results",
    "rotated",
    "write_json",
]

T = TypeVar("T")


def abba(items: Sequence[T], turn: int) -> list[T]:
    """``items`` in order on even turns, reversed on odd ones.

    Example:
        >>> [abba("AB", t) for t in range(3)]
        [['A', 'B'], ['B', 'A'], ['A', 'B']]
    """
    return list(items) if turn % 2 == 0 else list(items)[::-1]


def rotated(items: Sequence[T], turn: int) -> list[T]:
    """``items`` rotated left by ``turn`` (modulo their number).

    Example:
        >>> rotated("ABC", 4)
        ['B', 'C', 'A']
    """
    k = turn % len(items) if items else 0
    return [*items[k:], *items[:k]]


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or ``None`` when either is missing or ``b`` is zero."""
    return None if a is None or b is None or b == 0 else a / b


def paired_ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """``a[i] / b[i]`` for every turn ``i`` (the sequences must have the same length)."""
    return [x / y for x, y in zip(a, b, strict=True)]


def ratio_of_medians(a: Sequence[float], b: Sequence[float]) -> float:
    """``median(a) / median(b)``."""
    return statistics.median(a) / statistics.median(b)


def step_split(steps: Sequence[float], exposed: Sequence[float]) -> tuple[float, float, float]:
    """Median step, median exposed communication, and their difference (the compute left,
    compression's local work included), in the units given."""
    step, wait = statistics.median(steps), statistics.median(exposed)
    return step, wait, step - wait


def read_results(path: Path) -> dict[str, Any]:
    """The JSON document at ``path``; empty when the file is missing or not valid JSON."""
    try:
        doc = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
    return doc if isinstance(doc, dict) else {}


def write_json(path: Path, doc: Any, *, indent: int = 2) -> None:
    """Write ``doc`` as JSON with a final newline, creating the folder if needed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=indent, default=str) + "\n")


def merge_results(
    path: Path, benchmark: str, sections: Mapping[str, Any], *, indent: int = 2
) -> dict[str, Any]:
    """Replace ``sections`` of the results at ``path``, keeping the others; return the whole.

    Each mode of a benchmark (loopback, emulated network, ...) owns a section, so running one
    mode never erases another's figures. The document starts with ``benchmark`` and ``torch``
    (the version that wrote the newest section); existing keys keep their place.
    """
    import torch

    doc = read_results(path)
    doc.update(benchmark=benchmark, torch=torch.__version__)
    doc.update(sections)
    write_json(path, doc, indent=indent)
    return doc
