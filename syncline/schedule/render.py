"""PURE: show a schedule as a rank x tick grid, simulate its timeline, export a Chrome trace.

Two clocks, one dependency rule (``_engine``: list order per rank, a RECV waits for its
SEND, without communication a stage waits for its neighbour's compute):

- ``render_grid``: lockstep ticks. Every action, whatever its kind, takes one tick, and starts
  at the first tick after everything it depends on finished. For reading order, not timing.
- ``simulate``: costed events. F takes ``t_f``, B ``t_b``, RECOMPUTE ``t_r`` (default
  ``t_f``), REDUCE ``t_reduce``, STEP ``t_step``; SEND and RECV take no time on their rank
  and a message arrives ``t_comm`` after its SEND. With ``t_f == t_b`` (and zero-cost rest)
  the idle fraction of GPipe and 1F1B is exactly ``(d-1)/(m+d-1)`` (GPipe, Huang et al. 2019).

Example:
    >>> from syncline.schedule.generators import gpipe
    >>> print(render_grid(gpipe(2, 2)))
    gpipe: 2 stages on 2 ranks, m=2 micro-batches per batch; one tick per action
    tick   | 0       1       2       3       4       5       6       7
    rank 0 | 0F0     0F1     .       .       0B0     0B1     0REDUCE 0STEP
    rank 1 | .       1F0     1F1     1B0     1B1     1REDUCE 1STEP   .
    >>> bubble_fraction(simulate(gpipe(4, 4), t_f=1.0, t_b=1.0))
    0.42857142857142855
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from syncline.schedule._engine import execute
from syncline.schedule.ir import COMPUTE, Action, ActionKind, Schedule, ScheduleError

#: the kinds that keep a rank working; the others wait on the network or on other ranks
WORK = COMPUTE | {ActionKind.STEP}


def render_grid(schedule: Schedule, *, mark: Collection[tuple[int, int]] = ()) -> str:
    """Render the rank x tick grid of a lockstep run (one tick per action).

    Args:
        schedule: the schedule to draw.
        mark: ``(rank, index)`` positions in ``schedule.actions`` to draw as ``[1F0]``.

    Returns:
        A header line, a tick ruler, and one row per rank; ``.`` is an idle tick. If the run
        stalls (a deadlock) the actions that could not run follow in list order from the
        stall tick on, and a last line says so.
    """
    run = execute(schedule, lambda _: 1.0)
    cells: dict[int, dict[int, str]] = {}
    stall = int(max((end for ts in run.times.values() for _, end in ts), default=0.0))
    for rank, actions in schedule.actions.items():
        row: dict[int, str] = {}
        for i, action in enumerate(actions):
            done = i < len(run.times[rank])
            tick = int(run.times[rank][i][0]) if done else stall + i - len(run.times[rank])
            label = str(action)
            row[tick] = f"[{label}]" if (rank, i) in mark else label
        cells[rank] = row
    width = max([len(c) for row in cells.values() for c in row.values()] + [2]) + 1
    num_ticks = max((t + 1 for row in cells.values() for t in row), default=0)
    side = len(f"rank {schedule.num_ranks - 1}")
    lines = [
        f"{schedule.name}: {schedule.num_stages} stages on {schedule.num_ranks} ranks, "
        f"m={schedule.num_microbatches} micro-batches per batch; one tick per action",
        "tick".ljust(side) + " | " + "".join(str(t).ljust(width) for t in range(num_ticks)),
    ]
    for rank, row in cells.items():
        text = "".join(row.get(t, ".").ljust(width) for t in range(num_ticks))
        lines.append(f"rank {rank}".ljust(side) + f" | {text}")
    lines = [line.rstrip() for line in lines]
    if run.stalled:
        lines.append(
            f"stalled at tick {stall}: later cells of ranks {sorted(run.stalled)} never ran"
        )
    return "\n".join(lines)


@dataclass(frozen=True)
class Event:
    """One action's interval on its rank, in simulated time units."""

    rank: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """Per-rank events of a simulated run; time starts at 0.

    Attributes:
        name: the schedule's name.
        events: ``events[rank]`` in execution order.
    """

    name: str
    events: Mapping[int, tuple[Event, ...]]

    @property
    def makespan(self) -> float:
        return max((e.end for evs in self.events.values() for e in evs), default=0.0)

    @property
    def total_stage_time(self) -> float:
        """Ranks x makespan: the device time the run holds."""
        return len(self.events) * self.makespan

    def busy(self, rank: int) -> float:
        """Time ``rank`` spent working: in F, B, RECOMPUTE and STEP. Time in SEND, RECV and
        REDUCE is waiting for the network or other ranks, as it is in a measured run (a
        RECV blocks until its message is in), so it counts as idle."""
        return sum(e.end - e.start for e in self.events[rank] if e.action.kind in WORK)

    @property
    def busy_time(self) -> float:
        return sum(self.busy(rank) for rank in self.events)

    @property
    def idle_time(self) -> float:
        return self.total_stage_time - self.busy_time

    def idle_fractions(self) -> dict[int, float]:
        """Per rank (the stage, unless interleaved): the share of the makespan not working."""
        span = self.makespan
        return {r: 1.0 - self.busy(r) / span if span else 0.0 for r in self.events}


def simulate(
    schedule: Schedule,
    t_f: float = 1.0,
    t_b: float = 2.0,
    *,
    t_r: float | None = None,
    t_comm: float = 0.0,
    t_reduce: float = 0.0,
    t_step: float = 0.0,
) -> Timeline:
    """Simulate the schedule with per-kind costs; each action starts as early as it can.

    The schedule is assumed valid (run ``validate`` first for a full check).

    Raises:
        ScheduleError: the schedule deadlocks; the message has the grid, stuck actions marked.
    """
    costs = {
        ActionKind.FORWARD: t_f,
        ActionKind.BACKWARD: t_b,
        ActionKind.RECOMPUTE: t_f if t_r is None else t_r,
        ActionKind.REDUCE: t_reduce,
        ActionKind.STEP: t_step,
    }
    run = execute(schedule, lambda a: costs.get(a.kind, 0.0), latency=t_comm)
    if run.stalled:
        grid = render_grid(schedule, mark=run.stalled.items())
        raise ScheduleError(f"{schedule.name} deadlocks; stuck actions marked:\n{grid}")
    events = {
        rank: tuple(
            Event(rank, a, start, end)
            for a, (start, end) in zip(schedule.actions[rank], run.times[rank], strict=True)
        )
        for rank in schedule.actions
    }
    return Timeline(schedule.name, events)


def bubble_fraction(timeline: Timeline) -> float:
    """Idle time (not in F, B, RECOMPUTE or STEP) over total stage time (ranks x makespan);
    0.0 for an empty timeline."""
    total = timeline.total_stage_time
    return timeline.idle_time / total if total else 0.0


def to_chrome_trace(timeline: Timeline, *, us_per_unit: float = 1000.0) -> dict[str, object]:
    """The timeline as Chrome/Perfetto trace JSON: one ``ph="X"`` event per action.

    ``pid`` is 0, ``tid`` the rank (the stage, unless interleaved); one simulated time unit
    is ``us_per_unit`` microseconds (default: a unit reads as a millisecond).
    """
    events: list[dict[str, object]] = [
        {
            "name": str(e.action),
            "cat": e.action.kind.name,
            "ph": "X",
            "ts": e.start * us_per_unit,
            "dur": (e.end - e.start) * us_per_unit,
            "pid": 0,
            "tid": e.rank,
            "args": {"stage": e.action.stage, "microbatch": e.action.microbatch},
        }
        for evs in timeline.events.values()
        for e in evs
    ]
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"name": timeline.name}}
