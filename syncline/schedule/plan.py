"""PURE (no torch): which slice of a generated schedule each ``train_step`` call executes.

The runtime never re-derives an order: it executes slices of the lists the generators in
:mod:`syncline.schedule` produce (with SEND/RECV from ``add_communication``), relabelled with
the global batch number. Flush schedules (GPipe, 1F1B, interleaved) are one slice per batch,
the whole list. 2BW is never flushed, so a call ends on each rank right after the STEP of its
batch, and the forwards of the next batch that 1F1B puts before that STEP (``w_r = d-r-1`` of
them on stage r) belong to this call; the next call starts with that batch in flight. Slices
of ``two_bw(d, m, 3)``, ``two_bw(d, m, 2)`` and ``two_bw(d, m, 1)`` cover every case::

    start   no batch in flight, a next batch exists   two_bw(.., 3) up to STEP of batch 0
    steady  batch in flight, a next batch exists      two_bw(.., 3) after STEP b0 to STEP b1
    drain   batch in flight, no next batch (flush)    two_bw(.., 2) after STEP of batch 0
    single  no batch in flight, no next batch         two_bw(.., 1), all of it

Batch (and version) numbers in a slice are offsets: global = IR value + this call's batch
+ ``Segment.shift``. Global version ``k`` is the weights after ``k`` STEPs, so batch ``g`` of
a run started at batch ``g0`` uses version ``max(g-1, g0)``, as ``two_bw`` prescribes. 1F1B is
periodic once warmed up (``m >= d``), so ``start, steady, steady, ..., drain`` is exactly
``two_bw(d, m, n)`` cut at the STEPs; :func:`check_cut` verifies that no call waits for a
message that a later call sends, which makes a collective at the end of each call safe.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from syncline.schedule.generators import two_bw
from syncline.schedule.ir import Action, ActionKind, Schedule, ScheduleError
from syncline.schedule.passes import add_communication
from syncline.schedule.validate import validate

START, STEADY, DRAIN, SINGLE = "start", "steady", "drain", "single"

_SEND_OF = {ActionKind.RECV_F: ActionKind.SEND_F, ActionKind.RECV_B: ActionKind.SEND_B}


@dataclass(frozen=True)
class Segment:
    """One call's actions on every rank, with batch/version numbers relative to the call.

    Attributes:
        kind: ``"start"``, ``"steady"``, ``"drain"`` or ``"single"``.
        actions: ``actions[rank]``, as generated (plus communication).
        shift: global batch = IR batch + call batch + shift (likewise for versions).
    """

    kind: str
    actions: Mapping[int, Sequence[Action]]
    shift: int

    def at(self, rank: int, batch: int) -> list[Action]:
        """``rank``'s actions for the call that finishes global ``batch``, relabelled."""
        offset = batch + self.shift
        out = []
        for a in self.actions[rank]:
            b = offset if a.batch is None else a.batch + offset
            v = None if a.version is None else a.version + offset
            out.append(replace(a, batch=b, version=v))
        return out


@dataclass(frozen=True)
class Plan:
    """The slices of a schedule a pipeline runs, and the schedule's shape.

    Attributes:
        name: the schedule's registry name (:mod:`syncline.schedule.registry`).
        schedule: the generated one-batch schedule (2BW: three batches), for display.
        segments: by kind; flush schedules have only ``"single"``.
    """

    name: str
    schedule: Schedule
    segments: Mapping[str, Segment]

    @property
    def overlapping(self) -> bool:
        """Whether a call may start the next batch (2BW)."""
        return START in self.segments

    @property
    def num_ranks(self) -> int:
        return self.schedule.num_ranks

    def stages_of(self, rank: int) -> list[int]:
        """The stages ``rank`` runs, in increasing order."""
        return [s for s in range(self.schedule.num_stages) if self.schedule.rank_of(s) == rank]

    def choose(self, in_flight: bool, has_next: bool) -> Segment:
        """The segment for a call (see the module docstring's table)."""
        if not self.overlapping:
            return self.segments[SINGLE]
        kind = {(False, True): START, (True, True): STEADY, (True, False): DRAIN}
        return self.segments[kind.get((in_flight, has_next), SINGLE)]


def flush_plan(name: str, schedule: Schedule) -> Plan:
    """The plan of a flush schedule: one call runs the whole (communication-added) list.

    Args:
        name: the schedule's registry name.
        schedule: one batch's compute actions, as a generator returns them.

    Raises:
        ScheduleError: the schedule deadlocks or breaks a dependency (:func:`validate`).
    """
    schedule = add_communication(schedule)
    validate(schedule)
    return Plan(name, schedule, {SINGLE: Segment(SINGLE, schedule.actions, 0)})


def _steps(actions: Sequence[Action]) -> dict[int | None, int]:
    return {a.batch: i for i, a in enumerate(actions) if a.kind is ActionKind.STEP}


def two_bw_plan(name: str, d: int, m: int, recompute: bool) -> Plan:
    """2BW's four segments (the module docstring's table), checked to cut cleanly."""
    runs = {n: add_communication(two_bw(d, m, n, recompute=recompute)) for n in (1, 2, 3)}
    validate(runs[3])
    start, steady, drain = {}, {}, {}
    for r in range(d):
        three, two = runs[3].actions[r], runs[2].actions[r]
        cut3, cut2 = _steps(three), _steps(two)
        start[r] = three[: cut3[0] + 1]
        steady[r] = three[cut3[0] + 1 : cut3[1] + 1]
        drain[r] = two[cut2[0] + 1 :]
    segments = {
        START: Segment(START, start, 0),
        STEADY: Segment(STEADY, steady, -1),
        DRAIN: Segment(DRAIN, drain, -1),
        SINGLE: Segment(SINGLE, runs[1].actions, 0),
    }
    plan = Plan(name, runs[3], segments)
    check_cut(plan, [START, STEADY, STEADY, DRAIN])
    return plan


def calls(plan: Plan, kinds: Sequence[str]) -> list[dict[int, list[Action]]]:
    """The relabelled actions of consecutive calls ``kinds`` (call ``i`` finishes batch ``i``)."""
    return [
        {r: plan.segments[k].at(r, i) for r in range(plan.num_ranks)} for i, k in enumerate(kinds)
    ]


def check_cut(plan: Plan, kinds: Sequence[str]) -> None:
    """Every RECV's SEND happens in the same or an earlier call, never a later one.

    Raises:
        ScheduleError: naming the RECV, its call and the call of its SEND.
    """
    sent: dict[tuple[ActionKind, int, int | None, int | None], int] = {}
    sequence = calls(plan, kinds)
    for i, call in enumerate(sequence):
        for acts in call.values():
            for a in acts:
                if a.kind in (ActionKind.SEND_F, ActionKind.SEND_B):
                    sent[(a.kind, a.stage, a.microbatch, a.batch)] = i
    for i, call in enumerate(sequence):
        for rank, acts in call.items():
            for a in acts:
                if a.kind not in _SEND_OF:
                    continue
                peer = a.stage - 1 if a.kind is ActionKind.RECV_F else a.stage + 1
                at = sent.get((_SEND_OF[a.kind], peer, a.microbatch, a.batch))
                if at is None or at > i:
                    raise ScheduleError(
                        f"{plan.name}: {a} on rank {rank} in call {i} ({kinds[i]}) has its "
                        f"send in call {at}"
                    )
