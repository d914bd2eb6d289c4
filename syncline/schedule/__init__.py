"""PURE (no torch): pipeline schedules as data: the action IR, generators, passes, checks.

Example:
    >>> from syncline.schedule import add_communication, bubble_fraction, one_f_one_b
    >>> from syncline.schedule import simulate, validate
    >>> schedule = add_communication(one_f_one_b(4, 8))
    >>> validate(schedule)
    >>> round(bubble_fraction(simulate(schedule, t_f=1.0, t_b=1.0)), 4)
    0.2727
"""

from __future__ import annotations

from syncline.schedule.generators import gpipe, interleaved_1f1b, one_f_one_b, two_bw
from syncline.schedule.ir import Action, ActionKind, Schedule, ScheduleError, parse_action
from syncline.schedule.nccl import align_receives, check_nccl_order, nccl_plan, p2p_batches
from syncline.schedule.passes import add_communication, add_recompute
from syncline.schedule.plan import Plan, Segment
from syncline.schedule.registry import SCHEDULES, ScheduleSpec, build_plan, check_microbatches
from syncline.schedule.render import (
    Event,
    Timeline,
    bubble_fraction,
    render_grid,
    simulate,
    to_chrome_trace,
)
from syncline.schedule.validate import validate

__all__ = [
    "SCHEDULES",
    "Action",
    "ActionKind",
    "Event",
    "Plan",
    "Schedule",
    "ScheduleError",
    "ScheduleSpec",
    "Segment",
    "Timeline",
    "add_communication",
    "add_recompute",
    "align_receives",
    "bubble_fraction",
    "build_plan",
    "check_microbatches",
    "check_nccl_order",
    "gpipe",
    "interleaved_1f1b",
    "nccl_plan",
    "one_f_one_b",
    "p2p_batches",
    "parse_action",
    "render_grid",
    "simulate",
    "to_chrome_trace",
    "two_bw",
    "validate",
]
