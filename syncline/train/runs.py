"""Run directories read back: what ``syncline report`` compares, and its table.

A run directory holds config.json (the resolved config), metrics.jsonl (one record per
logged step) and, once the run finished, summary.json. :func:`load_run` reads them into a
:class:`Run` without torch (a report needs no training stack) and fails with one line naming
the directory and what is wrong; :func:`comparison_table` is a pure function of the runs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from syncline.errors import ConfigError
from syncline.fields import flatten
from syncline.train.config import TrainConfig

__all__ = ["Run", "comparison_table", "load_run", "peak_memory"]

#: how the table names a summary's ``peak_memory_kind``
_KIND = {"cuda_max_allocated": "cuda", "rss": "rss"}


@dataclass(frozen=True)
class Run:
    """One run directory's contents.

    Attributes:
        label: how the report names it (the directory as given).
        config: config.json, every setting by its flat name (``pipeline_stages``, not
            under ``pipeline``), whether the run nested its parts or wrote them flat.
        records: metrics.jsonl, one dict per logged step.
        summary: summary.json, or ``{}`` for a run that did not finish.
        events: the non-finite guard's events in metrics.jsonl (step, kind, action, ...).
    """

    label: str
    config: dict[str, Any]
    records: list[dict[str, Any]]
    summary: dict[str, Any]
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def layout(self) -> str:
        """How the run was parallelised, e.g. ``dp x2`` or ``1f1b 2x1 m=4``."""
        c = self.config
        world = c.get("nnodes", 1) * c.get("nproc_per_node", 1)
        stages = c.get("pipeline_stages", 1)
        if stages <= 1:
            compression = c.get("compression", "none")
            return f"dp x{world}" + ("" if compression == "none" else f" {compression}")
        return f"{c.get('schedule')} {stages}x{world // stages} m={c.get('microbatches')}"


def peak_memory(summary: dict[str, Any]) -> tuple[list[int], str]:
    """Each rank's peak memory in ``summary`` and what was measured: on the rank's device
    (``peak_memory_bytes_per_rank``, ``peak_memory_kind``: ``cuda_max_allocated`` on GPUs,
    ``rss`` on the CPU), or for runs written before GPUs were measured the resident set.

    Example:
        >>> peak_memory({"peak_rss_bytes_per_rank": [7, 9]})
        ([7, 9], 'rss')
    """
    device = summary.get("peak_memory_bytes_per_rank")
    if device:
        return list(device), str(summary.get("peak_memory_kind", "rss"))
    return list(summary.get("peak_rss_bytes_per_rank") or []), "rss"


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path.parent}: no {path.name}; {what}") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot be read ({exc})") from None


def load_run(path: str | Path) -> Run:
    """The run in directory ``path``.

    Raises:
        ConfigError: no such directory, or no readable config.json or metrics.jsonl with at
            least one record (summary.json may be missing: a run that stopped early).
    """
    run_dir = Path(path)
    if not run_dir.is_dir():
        raise ConfigError(f"{path}: not a run directory (no such directory)")
    hint = "not a syncline run directory (syncline train --run-dir DIR writes one)"
    config = _read_json(run_dir / "config.json", hint)
    metrics = run_dir / "metrics.jsonl"
    try:
        text = metrics.read_text().splitlines()
        lines: list[dict[str, Any]] = [json.loads(line) for line in text if line.strip()]
        records = [d for d in lines if "guard_event" not in d]  # the guard's events apart
    except FileNotFoundError:
        raise ConfigError(f"{run_dir}: no metrics.jsonl; {hint}") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{metrics}: cannot be read ({exc})") from None
    if not records:
        raise ConfigError(f"{metrics}: no records yet (the run logged no step)")
    summary_path = run_dir / "summary.json"
    summary = _read_json(summary_path, "") if summary_path.is_file() else {}
    if not isinstance(config, dict) or not isinstance(summary, dict):
        raise ConfigError(f"{run_dir}: config.json or summary.json is not a JSON object")
    events = [d["guard_event"] for d in lines if "guard_event" in d]
    return Run(str(path), flatten(TrainConfig, config), records, summary, events)


def _median(values: list[float]) -> float | None:
    values = sorted(values)
    if not values:
        return None
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def _bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def row(run: Run) -> dict[str, str]:
    """The table's cells of ``run``: from summary.json where it has them, else the records
    (medians past the first record, which includes warm-up, as summary.json's)."""
    s, records = run.summary, run.records
    steady = records[1:] or records
    samples = s.get("median_samples_per_s") or _median([r["samples_per_s"] for r in steady])
    tokens = s.get("median_tokens_per_s") or _median([r["tokens_per_s"] for r in steady])
    wires = [r["wire_bytes"] for r in steady if r.get("wire_bytes") is not None]
    wire = s.get("wire_bytes_per_step", _median(wires))
    val = [r["val_loss"] for r in records if r.get("val_loss") is not None]
    best = s.get("best_val_loss", min(val) if val else None)
    peaks, kind = peak_memory(s)
    c = run.config
    return {
        "run": run.label,
        "model": f"{c.get('model')}/{c.get('data') or s.get('data') or '-'}",
        "layout": run.layout,
        "steps": str(records[-1]["step"] + 1) + ("" if s else "*"),
        "final loss": _number(records[-1]["loss"], ".4f"),
        "best val": _number(best, ".4f"),
        "samples/s": _number(samples, ".1f"),
        "tokens/s": _number(tokens, ".0f"),
        "wire/step": _bytes(wire),
        "peak memory": f"{_bytes(max(peaks))} {_KIND.get(kind, kind)}" if peaks else "-",
        "time": _number(records[-1].get("elapsed_s"), ".1f") + "s",
        "guard": _guard_cell(run),
    }


def _guard_cell(run: Run) -> str:
    """The non-finite guard's events, e.g. ``2 skip`` or ``stop@17`` (``-``: none)."""
    events = run.events
    if not events:
        return "stopped" if run.summary.get("stopped") else "-"
    action = events[-1].get("action", "?")
    if action == "skip":
        return f"{len(events)} skip"
    return ",".join(f"{e.get('action', '?')}@{e.get('step')}" for e in events)


def comparison_table(runs: list[Run]) -> str:
    """One row per run, columns aligned; ``*`` marks a run without summary.json.

    Example:
        >>> run = Run("a", {"model": "gpt"}, [{"step": 0, "loss": 2.0, "samples_per_s": 8.0,
        ...     "tokens_per_s": 512.0, "wire_bytes": 2048, "elapsed_s": 1.5}], {})
        >>> comparison_table([run]).splitlines()[2].split()
        ['a', 'gpt/-', 'dp', 'x1', '1*', '2.0000', '-', '8.0', '512', '2.0', 'KiB', '-', '1.5s']
    """
    rows = [row(r) for r in runs]
    if not any(r.events for r in runs):  # the guard's column only where it acted
        for cells in rows:
            del cells["guard"]
    columns = list(rows[0]) if rows else []
    widths = {c: max(len(c), *(len(r[c]) for r in rows)) for c in columns}
    numeric = set(columns) - {"run", "model", "layout"}

    def line(cells: dict[str, str]) -> str:
        parts = [cells[c].rjust(widths[c]) if c in numeric else cells[c].ljust(widths[c])
                 for c in columns]  # fmt: skip
        return "  ".join(parts).rstrip()

    header = line({c: c for c in columns})
    lines = [header, "-" * len(header), *(line(r) for r in rows)]
    if any(not r.summary for r in runs):
        lines.append("* no summary.json: the run did not finish; figures from metrics.jsonl")
    return "\n".join(lines)
