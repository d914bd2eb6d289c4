"""A Gantt chart of executed pipeline actions: one row per stage, time on x, kinds coloured.

The input is a :class:`~syncline.schedule.Timeline` (plain data: what ran where and when), so
the same function draws a measured run (``Pipeline.trace``) or a simulated one
(``syncline.schedule.simulate``). Compute (forward, backward, recompute) fills a row; sends
and receives are thin bars along its bottom edge, so waiting shows as white space; REDUCE and
STEP are dark. Boxes wide enough to hold text show their micro-batch number; alternate
batches are drawn lighter, so where 2BW overlaps two batches can be seen.
"""

from __future__ import annotations

from pathlib import Path

from syncline.extras import installed
from syncline.schedule import ActionKind, Event, Timeline

K = ActionKind
COLOURS: dict[ActionKind, str] = {
    K.FORWARD: "#4C72B0",
    K.BACKWARD: "#DD8452",
    K.RECOMPUTE: "#8172B3",
    K.SEND_F: "#55A868",
    K.RECV_F: "#A6D8A8",
    K.SEND_B: "#C44E52",
    K.RECV_B: "#E8A5A7",
    K.REDUCE: "#937860",
    K.STEP: "#333333",
}
_COMPUTE = (K.FORWARD, K.BACKWARD, K.RECOMPUTE)
_LABELS = {
    K.FORWARD: "forward",
    K.BACKWARD: "backward",
    K.RECOMPUTE: "recompute",
    K.SEND_F: "send activation",
    K.RECV_F: "recv activation",
    K.SEND_B: "send gradient",
    K.RECV_B: "recv gradient",
    K.REDUCE: "reduce",
    K.STEP: "optimizer step",
}


def _box(event: Event, t0: float) -> tuple[float, float, float, float]:
    """``(left ms, width ms, bottom, height)`` of an event in its stage's row."""
    left, width = (event.start - t0) * 1e3, (event.end - event.start) * 1e3
    row = event.action.stage
    if event.action.kind in _COMPUTE or event.action.kind in (K.REDUCE, K.STEP):
        return left, width, row - 0.4, 0.8
    offset = 0.28 if event.action.kind in (K.SEND_F, K.SEND_B) else 0.4
    return left, width, row + offset - 0.12, 0.12


def plot_schedule(timeline: Timeline, path: Path, title: str) -> Path | None:
    """Write the Gantt chart of ``timeline`` (times in seconds) as a PNG; returns ``path``
    (``None`` without matplotlib, the ``plot`` extra: trace.json holds the same events)."""
    if not installed("matplotlib"):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    events = [e for evs in timeline.events.values() for e in evs]
    stages = sorted({e.action.stage for e in events}) or [0]
    t0 = min((e.start for e in events), default=0.0)
    span = max(((e.end - t0) * 1e3 for e in events), default=1.0) or 1.0
    fig, ax = plt.subplots(figsize=(14, 1.4 + 0.8 * len(stages)), dpi=100)
    for e in events:
        left, width, bottom, height = _box(e, t0)
        light = (e.action.batch or 0) % 2 == 1
        ax.bar(
            left,
            height,
            width=max(width, span * 1e-4),
            bottom=bottom,
            align="edge",
            color=COLOURS[e.action.kind],
            alpha=0.6 if light else 1.0,
            edgecolor="white" if e.action.kind in _COMPUTE else "none",
            linewidth=0.4,
        )
        if e.action.kind in _COMPUTE and width > span / 160:
            ax.text(
                left + width / 2,
                e.action.stage,
                str(e.action.microbatch),
                ha="center",
                va="center",
                fontsize=6,
                color="white",
            )
    kinds = [k for k in COLOURS if any(e.action.kind is k for e in events)]
    fig.legend(
        handles=[Patch(color=COLOURS[k], label=_LABELS[k]) for k in kinds],
        loc="lower center",
        ncol=min(len(kinds), 9) or 1,
        fontsize=8,
        frameon=False,
    )
    rank_of = {e.action.stage: e.rank for e in events}
    ax.set_yticks(stages, [f"stage {s} (rank {rank_of.get(s, s)})" for s in stages])
    ax.set_ylim(max(stages) + 0.6, min(stages) - 0.6)
    ax.set_xlim(0, span * 1.01)
    ax.set_xlabel("time (ms)")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout(rect=(0.0, 0.3 / (1.4 + 0.8 * len(stages)), 1.0, 1.0))
    fig.savefig(path)
    plt.close(fig)
    return path
