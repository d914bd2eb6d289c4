"""PURE: passes that rewrite a compute-only schedule: recomputation and point-to-point comm.

Generators emit only what each stage computes; these passes add what follows from it, so the
order is written once. ``add_communication`` puts each RECV right before the action that
needs the tensor and each SEND right after the action that made it: with buffered sends
(``isend``) this keeps exactly the dependencies of the compute-only schedule, so a schedule
that runs without communication also runs with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from syncline.schedule.ir import COMM, Action, ActionKind, Schedule, ScheduleError

F, B, R = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.RECOMPUTE


def add_recompute(actions: Sequence[Action]) -> list[Action]:
    """Put a RECOMPUTE of the same micro-batch (same version) right before each BACKWARD.

    Activation checkpointing: the forward kept only its input, so the backward first re-runs
    the forward to rebuild the activations; doing it just in time keeps one micro-batch's
    activations alive instead of all in-flight ones.
    """
    out: list[Action] = []
    for action in actions:
        if action.kind is B:
            out.append(replace(action, kind=R))
        out.append(action)
    return out


def _comm(action: Action, kind: ActionKind) -> Action:
    # Tensors carry no weight version; the batch tells micro-batches of different batches apart.
    return Action(action.stage, kind, action.microbatch, batch=action.batch)


def add_communication(schedule: Schedule) -> Schedule:
    """Insert SEND_F/RECV_F/SEND_B/RECV_B between adjacent stages.

    Stage s's forward of micro-batch i is followed by ``sSEND_Fi`` and stage s+1's forward of
    it preceded by ``(s+1)RECV_Fi``; backwards mirror this (``SEND_B`` after stage s's
    backward, ``RECV_B`` on stage s-1 right before its backward, after any RECOMPUTE).

    Raises:
        ScheduleError: the schedule already has communication actions.

    Example:
        >>> from syncline.schedule.generators import gpipe
        >>> add_communication(gpipe(2, 1)).to_strings()[1]
        '1RECV_F0 1F0 1B0 1SEND_B0 1REDUCE 1STEP'
    """
    last = schedule.num_stages - 1
    rows: dict[int, list[Action]] = {}
    for rank, actions in schedule.actions.items():
        row: list[Action] = []
        for action in actions:
            if action.kind in COMM:
                raise ScheduleError(f"{schedule.name} already has communication ({action})")
            s = action.stage
            if action.kind is F and s > 0:
                row.append(_comm(action, ActionKind.RECV_F))
            if action.kind is B and s < last:
                row.append(_comm(action, ActionKind.RECV_B))
            row.append(action)
            if action.kind is F and s < last:
                row.append(_comm(action, ActionKind.SEND_F))
            if action.kind is B and s > 0:
                row.append(_comm(action, ActionKind.SEND_B))
        rows[rank] = row
    return replace(schedule, actions=rows)
