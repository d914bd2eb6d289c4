"""``syncline report``'s figure: several runs side by side in one PNG.

Six panels, one colour per run: the loss against the step and against wall time (training
solid, validation as dots joined by a dashed line), samples/s and bytes on the wire per
step against the step, the peak memory of each rank (on its device: the CUDA allocator's
peak on GPUs, the resident set on the CPU; the legend says which), and, for pipelines, the peak
stashed activations of each stage. A figure of :class:`~syncline.train.runs.Run` data only:
what a run did not record (a data-parallel run has no stages) leaves its panel with a note.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from syncline.train.runs import Run, peak_memory

__all__ = ["plot_report"]

_MIB = 1024 * 1024


def _series(run: Run, key: str) -> tuple[list[int], list[float]]:
    """``(steps, values)`` of the records that have ``key``; a pipeline's bytes on the wire
    are placed at the last step of the interval they are the rate of (``wire_steps``)."""
    steps, values = [], []
    for r in run.records:
        if r.get(key) is None:
            continue
        at = r["wire_steps"][1] if key == "wire_bytes" and r.get("wire_steps") else r["step"]
        steps.append(at)
        values.append(float(r[key]))
    return steps, values


def _bars(ax: Any, groups: list[tuple[str, list[float]]], xlabel: str, empty: str) -> None:
    """Grouped bars: one group per index (rank or stage), one bar per run, in MiB."""
    shown = [(i, label, values) for i, (label, values) in enumerate(groups) if values]
    if not shown:
        ax.text(0.5, 0.5, empty, ha="center", va="center", transform=ax.transAxes, fontsize=9)
        ax.set_xticks([])
        return
    width = 0.8 / len(groups)
    for i, label, values in shown:
        xs = [x - 0.4 + width * (i + 0.5) for x in range(len(values))]
        ax.bar(xs, [v / _MIB for v in values], width=width, color=f"C{i}", label=label)
    most = max(len(values) for _, _, values in shown)
    ax.set_xticks(range(most))
    ax.set_xlabel(xlabel)
    ax.set_ylabel("MiB")


def plot_report(runs: list[Run], path: Path, title: str = "syncline runs") -> Path:
    """Write the comparison of ``runs`` as a PNG (matplotlib's Agg backend); returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5), dpi=100)
    (by_step, by_time, rate), (wire, rss, stages) = axes
    for i, run in enumerate(runs):
        colour, label = f"C{i}", run.label
        records = run.records
        by_step.plot(
            [r["step"] for r in records],
            [r["loss"] for r in records],
            color=colour,
            lw=1.4,
            label=f"{label} (training)",
        )
        by_time.plot(
            [r["elapsed_s"] for r in records],
            [r["loss"] for r in records],
            color=colour,
            lw=1.4,
            label=label,
        )
        validated = [r for r in records if r.get("val_loss") is not None]
        if validated:
            by_step.plot(
                [r["step"] for r in validated],
                [r["val_loss"] for r in validated],
                "o--",
                color=colour,
                ms=3,
                lw=1,
                label=f"{label} (validation)",
            )
            by_time.plot(
                [r["elapsed_s"] for r in validated],
                [r["val_loss"] for r in validated],
                "o--",
                color=colour,
                ms=3,
                lw=1,
            )
        rate.plot(*_series(run, "samples_per_s"), color=colour, lw=1.2, label=label)
        steps, values = _series(run, "wire_bytes")
        wire.plot(steps, [v / _MIB for v in values], ".-", color=colour, lw=1.2, label=label)
    for ax, ylabel, xlabel, name in (
        (by_step, "loss", "step", "loss by step"),
        (by_time, "loss", "wall time (s)", "loss by wall time"),
        (rate, "samples/s", "step", "throughput"),
        (wire, "MiB per step", "step", "bytes on the wire per step (all ranks)"),
    ):
        ax.set(xlabel=xlabel, ylabel=ylabel, title=name)
        ax.grid(alpha=0.3)
    for ax in (rate, wire):  # rates compared from zero, not from the smallest
        ax.set_ylim(bottom=0)
    by_step.legend(fontsize=7)
    rss_groups = []
    for r in runs:
        peaks, kind = peak_memory(r.summary)
        rss_groups.append((f"{r.label} ({kind})", [float(p) for p in peaks]))
    _bars(rss, rss_groups, "rank", "no summary.json: peak memory is recorded at the end")
    rss.set_title("peak memory per rank")
    stage_groups = [
        (r.label, [m["peak_activation_bytes"] for _, m in sorted(_memory(r).items())]) for r in runs
    ]
    _bars(stages, stage_groups, "stage", "no pipeline run: memory per stage not recorded")
    stages.set_title("peak stashed activations per stage")
    for ax in (rss, stages):
        ax.grid(axis="y", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _memory(run: Run) -> dict[int, dict[str, Any]]:
    """A pipeline's per-stage memory from summary.json (keys are stage numbers as text)."""
    memory = run.summary.get("memory") or {}
    return {int(stage): stats for stage, stats in memory.items()}
