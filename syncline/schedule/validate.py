"""PURE: check that a schedule is complete, correctly ordered, matched and deadlock-free.

A runtime executes a schedule without re-deriving it, so every rule it relies on is checked
here, once, in this order: placement (stage on the right rank, indices in range), order on
each rank (forward before recompute before backward, RECV before use, SEND after the tensor
exists, REDUCE/STEP after the batch's backwards), weight versions (2BW: a micro-batch's
forward, recompute and backward use one version, a batch uses one version on all stages, at
most 2 versions live per stage), SEND/RECV matching, completeness (every stage runs F and B
of every micro-batch), and a blocking simulation for deadlock. Each failure raises
``ScheduleError`` with the grid, the failing action marked.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import NoReturn

from syncline.schedule._engine import Key, cross_dependency, execute, has_communication, key
from syncline.schedule.ir import Action, ActionKind, Schedule, ScheduleError
from syncline.schedule.render import render_grid

K = ActionKind


def _fail(schedule: Schedule, problem: str, mark: Collection[tuple[int, int]] = ()) -> NoReturn:
    grid = render_grid(schedule, mark=mark)
    raise ScheduleError(f"{schedule.name}: {problem}\n{grid}")


def validate(schedule: Schedule) -> None:
    """Raise ``ScheduleError`` unless the schedule is safe to execute.

    Raises:
        ScheduleError: the first broken rule, with the rank x tick grid and the failing
            action(s) marked ``[...]``.

    Example:
        >>> from syncline.schedule.generators import one_f_one_b
        >>> validate(one_f_one_b(4, 8))
    """
    with_comm = has_communication(schedule)
    for rank, actions in schedule.actions.items():
        for i, action in enumerate(actions):
            _check_placement(schedule, rank, i, action)
    for rank, actions in schedule.actions.items():
        _check_order(schedule, rank, actions, with_comm)
        for stage in sorted({a.stage for a in actions}):
            _check_versions(schedule, rank, stage)
    _check_batch_versions(schedule)
    _check_matching(schedule)
    _check_complete(schedule)
    _check_deadlock(schedule, with_comm)


def _check_placement(schedule: Schedule, rank: int, i: int, a: Action) -> None:
    last = schedule.num_stages - 1
    where = [(rank, i)]
    if a.stage > last:
        _fail(schedule, f"{a} on rank {rank}: stage must be < {schedule.num_stages}", where)
    if schedule.rank_of(a.stage) != rank:
        home = schedule.rank_of(a.stage)
        _fail(schedule, f"{a} is on rank {rank} but stage {a.stage} runs on rank {home}", where)
    if a.microbatch is not None and a.microbatch >= schedule.num_microbatches:
        _fail(schedule, f"{a}: micro-batch must be < {schedule.num_microbatches}", where)
    edge = {K.SEND_F: a.stage < last, K.RECV_B: a.stage < last}
    edge.update({K.RECV_F: a.stage > 0, K.SEND_B: a.stage > 0})
    if not edge.get(a.kind, True):
        _fail(schedule, f"{a} on rank {rank}: stage {a.stage} has no such neighbour", where)


def _needs(a: Action, last: int, with_comm: bool) -> list[Key]:
    """Actions that must come earlier on the same rank."""
    s, mb, b = a.stage, a.microbatch, a.batch
    if a.kind is K.FORWARD:
        return [(K.RECV_F, s, mb, b)] if with_comm and s > 0 else []
    if a.kind is K.RECOMPUTE:
        return [(K.FORWARD, s, mb, b)]
    if a.kind is K.BACKWARD:
        recv = [(K.RECV_B, s, mb, b)] if with_comm and s < last else []
        return [(K.FORWARD, s, mb, b), *recv]
    if a.kind is K.SEND_F:
        return [(K.FORWARD, s, mb, b)]
    if a.kind is K.SEND_B:
        return [(K.BACKWARD, s, mb, b)]
    return []


def _check_order(schedule: Schedule, rank: int, actions: Sequence[Action], with_comm: bool) -> None:
    last = schedule.num_stages - 1
    seen: set[Key] = set()
    backwards: dict[tuple[int, int | None], int] = {}
    for i, a in enumerate(actions):
        where = [(rank, i)]
        if key(a) in seen:
            _fail(schedule, f"{a} appears twice on rank {rank}", where)
        for need in _needs(a, last, with_comm):
            if need not in seen:
                _fail(schedule, f"{a} needs {_show(need)} earlier on rank {rank}", where)
        if a.kind is K.RECOMPUTE and (K.BACKWARD, a.stage, a.microbatch, a.batch) in seen:
            _fail(schedule, f"{a} comes after its backward on rank {rank}", where)
        if a.kind is K.BACKWARD:
            backwards[(a.stage, a.batch)] = backwards.get((a.stage, a.batch), 0) + 1
        done = backwards.get((a.stage, a.batch), 0)
        if a.kind in (K.REDUCE, K.STEP) and done < schedule.num_microbatches:
            _fail(
                schedule,
                f"{a} after only {done} of {schedule.num_microbatches} backwards of its batch",
                where,
            )
        seen.add(key(a))


def _show(k: Key) -> str:
    kind, stage, mb, batch = k
    return str(Action(stage, kind, mb, batch=batch))


def _check_versions(schedule: Schedule, rank: int, stage: int) -> None:
    """2BW: one version per micro-batch, used only once produced, at most 2 live per stage."""
    acts = [(i, a) for i, a in enumerate(schedule.actions[rank]) if a.stage == stage]
    latest, produced_at = 0, {0: -1}
    forward_version: dict[tuple[int | None, int | None], int | None] = {}
    last_use: dict[int, int] = {}
    for i, a in acts:
        where = [(rank, i)]
        if a.kind is K.STEP:
            if a.version is not None and a.version != latest + 1:
                _fail(schedule, f"{a} should produce v{latest + 1} after v{latest}", where)
            latest += 1
            produced_at[latest] = i
        if a.kind not in (K.FORWARD, K.RECOMPUTE, K.BACKWARD):
            continue
        mb = (a.microbatch, a.batch)
        if a.kind is K.FORWARD:
            forward_version[mb] = a.version
            if a.version is not None and a.version > latest:
                _fail(schedule, f"{a} uses v{a.version} before it exists (latest v{latest})", where)
        elif a.version != forward_version.get(mb):
            fv = forward_version.get(mb)
            _fail(schedule, f"{a} uses version {a.version} but its forward used {fv}", where)
        if a.version is not None:
            last_use[a.version] = i
    for v, at in produced_at.items():
        live = [u for u in produced_at if u < v and last_use.get(u, -1) > at] + [v]
        if len(live) > 2:
            versions = ", ".join(f"v{u}" for u in live)
            _fail(schedule, f"stage {stage} holds {versions} at once; 2BW keeps 2", [(rank, at)])


def _check_batch_versions(schedule: Schedule) -> None:
    """2BW: all micro-batches of a batch use one version on every stage (one-step delay).

    Otherwise a batch's accumulated gradient would mix gradients taken at different weights.
    """
    seen: dict[int | None, Action] = {}
    for rank, actions in schedule.actions.items():
        for i, a in enumerate(actions):
            if a.kind not in (K.FORWARD, K.RECOMPUTE, K.BACKWARD):
                continue
            first = seen.setdefault(a.batch, a)
            if a.version != first.version:
                problem = f"{a} and {first} are in one batch but use different versions"
                _fail(schedule, problem, [(rank, i)])


def _check_matching(schedule: Schedule) -> None:
    partner = {K.SEND_F: (K.RECV_F, 1), K.RECV_F: (K.SEND_F, -1)}
    partner.update({K.SEND_B: (K.RECV_B, -1), K.RECV_B: (K.SEND_B, 1)})
    present = {key(a) for acts in schedule.actions.values() for a in acts}
    for rank, actions in schedule.actions.items():
        for i, a in enumerate(actions):
            if a.kind not in partner:
                continue
            kind, step = partner[a.kind]
            other: Key = (kind, a.stage + step, a.microbatch, a.batch)
            if other not in present:
                _fail(schedule, f"{a} on rank {rank} has no matching {_show(other)}", [(rank, i)])


def _check_complete(schedule: Schedule) -> None:
    """Every stage runs a forward and a backward of every micro-batch of every batch."""
    ran = {
        (a.kind, a.stage, a.microbatch, a.batch) for acts in schedule.actions.values() for a in acts
    }
    batches = {a.batch for acts in schedule.actions.values() for a in acts if a.kind is K.FORWARD}
    for stage in range(schedule.num_stages):
        for kind in (K.FORWARD, K.BACKWARD):
            missing = [
                Action(stage, kind, i, batch=b)
                for b in sorted(batches or {None}, key=lambda b: -1 if b is None else b)
                for i in range(schedule.num_microbatches)
                if (kind, stage, i, b) not in ran
            ]
            if missing:
                shown = " ".join(str(a) for a in missing[:4]) + (" ..." if len(missing) > 4 else "")
                _fail(schedule, f"incomplete: stage {stage} never runs {shown}")


def _check_deadlock(schedule: Schedule, with_comm: bool) -> None:
    run = execute(schedule, lambda _: 1.0)
    if not run.stalled:
        return
    waits = []
    for rank, i in sorted(run.stalled.items()):
        a = schedule.actions[rank][i]
        dep = cross_dependency(a, schedule.num_stages, with_comm)
        waits.append(f"rank {rank} waits at {a} for {_show(dep) if dep else '?'}")
    _fail(schedule, "deadlock: " + "; ".join(waits), run.stalled.items())
