"""PURE: the cross-rank dependency rule and an as-soon-as-possible executor over the IR.

Shared by ``validate`` (deadlock check), ``render_grid`` (lockstep ticks) and ``simulate``
(costed timeline), so all three agree on when an action may run:

- each rank runs its actions in list order, one at a time;
- a RECV waits for its matching SEND (SENDs are buffered, like ``isend``: they never wait);
- in a schedule without SEND/RECV actions, a forward of stage ``s`` waits for the forward of
  the same micro-batch on stage ``s-1``, and a backward for the backward on stage ``s+1``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from syncline.schedule.ir import COMM, Action, ActionKind, Schedule

Key = tuple[ActionKind, int, int | None, int | None]
"""An action's identity for matching: (kind, stage, micro-batch, batch); version excluded."""

RECVS = frozenset({ActionKind.RECV_F, ActionKind.RECV_B})


def key(action: Action) -> Key:
    return (action.kind, action.stage, action.microbatch, action.batch)


def has_communication(schedule: Schedule) -> bool:
    return any(a.kind in COMM for acts in schedule.actions.values() for a in acts)


def cross_dependency(action: Action, num_stages: int, with_comm: bool) -> Key | None:
    """The action (on another stage) that must finish before ``action`` may start."""
    s, mb, b = action.stage, action.microbatch, action.batch
    kind = action.kind
    if kind is ActionKind.RECV_F:
        return (ActionKind.SEND_F, s - 1, mb, b)
    if kind is ActionKind.RECV_B:
        return (ActionKind.SEND_B, s + 1, mb, b)
    if with_comm:
        return None
    if kind is ActionKind.FORWARD and s > 0:
        return (ActionKind.FORWARD, s - 1, mb, b)
    if kind is ActionKind.BACKWARD and s < num_stages - 1:
        return (ActionKind.BACKWARD, s + 1, mb, b)
    return None


@dataclass(frozen=True)
class Run:
    """What ``execute`` found.

    Attributes:
        times: ``times[rank][i]`` is the (start, end) of that rank's ``i``-th action, for the
            actions that ran.
        stalled: ``{rank: index}`` of the first action that could never start; empty when
            every action ran.
    """

    times: dict[int, list[tuple[float, float]]]
    stalled: dict[int, int]


def execute(
    schedule: Schedule,
    cost: Callable[[Action], float],
    latency: float | Callable[[Action], float] = 0.0,
) -> Run:
    """Run every rank as soon as its dependencies allow.

    Args:
        schedule: the schedule to run.
        cost: duration of each action on its rank.
        latency: delay between a SEND finishing and its RECV being able to finish: one for
            every message, or a function of the RECV (messages of different sizes).

    Returns:
        The start/end times, and where it stalled (a deadlock) if it did.
    """
    with_comm = has_communication(schedule)
    delay_of = latency if callable(latency) else (lambda _a: float(latency))
    ends: dict[Key, float] = {}
    pos = dict.fromkeys(schedule.actions, 0)
    free = dict.fromkeys(schedule.actions, 0.0)
    times: dict[int, list[tuple[float, float]]] = {r: [] for r in schedule.actions}
    progress = True
    while progress:
        progress = False
        for rank, acts in schedule.actions.items():
            while pos[rank] < len(acts):
                action = acts[pos[rank]]
                start = free[rank]
                dep = cross_dependency(action, schedule.num_stages, with_comm)
                if dep is not None:
                    if dep not in ends:
                        break
                    delay = delay_of(action) if action.kind in RECVS else 0.0
                    start = max(start, ends[dep] + delay)
                end = start + cost(action)
                times[rank].append((start, end))
                ends.setdefault(key(action), end)
                free[rank] = end
                pos[rank] += 1
                progress = True
    stalled = {r: i for r, i in pos.items() if i < len(schedule.actions[r])}
    return Run(times, stalled)
