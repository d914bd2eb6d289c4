"""PURE (no torch): issue a rank's sends and receives as NCCL groups, and prove it cannot hang.

gloo matches messages by tag and buffers them, so any issue order works. NCCL does neither,
and :func:`check_nccl_order` replays every rank's actions under its rules:

1. **Issue order.** The point-to-point operations between two ranks run on one
   communicator, in the order they were issued; tags are ignored, so rank a's k-th send to
   rank b is rank b's k-th receive from a (a mismatch is an error even where nothing hangs:
   it would deliver the wrong tensor).
2. **Rendezvous.** A send larger than NCCL's eager buffer (activations are) completes only
   while the peer's matching receive is running; whatever was issued after it on the same
   stream waits. Small messages (the batch loss) complete eagerly; ``eager=True`` treats
   every send so (the best case), the default none (the worst).
3. **Groups.** The operations of one ``batch_isend_irecv`` (``ncclGroupStart/End``) run as
   one kernel and progress together; the group leaves its stream when all of them are done,
   and only then is any of them done for the waiter (torch returns one work per batch).
4. **The host** (standing in for the compute stream, which later launches wait for) runs
   its list in order and never blocks to launch; a forward waits for the group of its
   ``RECV_F``, a backward for that of its ``RECV_B``; the end of a call waits for the
   sends as the runtime's ``wait_sends`` does (those of earlier calls, or all in a drain or
   single call), then the last stage averages the loss over its replicas and sends it to
   every other rank, which waits for it; ``REDUCE`` is a barrier among the stage's replicas
   (on their own communicator).

Streams are FIFOs of groups, in two models, both checked by default: ``"pair"``, one per
rank and peer (the 2-rank communicators torch makes for ``isend``/``irecv``; a group with
two peers must head both), and ``"rank"``, one per rank (torch runs a coalesced batch on the
group's main communicator). 1F1B with d=2, m=4, today one ``isend``/``irecv`` per action::

    rank 0 | 0F0 [0SEND_F0] 0F1 [0SEND_F1] [0RECV_B0] 0B0 ...    stream head: 0SEND_F1
    rank 1 | [1RECV_F0] 1F0 1B0 [1SEND_B0] [1RECV_F1] 1F1 ...    stream head: 1SEND_B0

Both heads are sends, each waiting for a receive queued behind the other: a deadlock (both
hosts wait at their next F/B). :func:`p2p_batches` makes each run of adjacent SEND/RECV one
group, ``[0SEND_F1 0RECV_B0]`` and ``[1SEND_B0 1RECV_F1]``: both run at once and all four
operations match, as in torch's pipelining, which batches each step's operations alike.

That suffices for GPipe, 1F1B, and 2BW without recompute. Two orders still hang, as a
rank's lone send precedes, past some computation, the group holding the receive that its
peer's head waits for: 2BW with recompute (a RECOMPUTE splits a send from the next
``RECV_B``, while the peer's call ends between its send and its receive), fixed by
:func:`receive_before_recompute`; and interleaved 1F1B, fixed by :func:`align_receives`,
which posts each receive where its send is issued in the lockstep timeline (torch's
step-wise batches). :func:`nccl_plan` returns the first order the replay proves safe.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from syncline.errors import ConfigError
from syncline.fields import check_int
from syncline.schedule._engine import Key, execute
from syncline.schedule._nccl_replay import Builder, Grouping, Replay, explain
from syncline.schedule.ir import COMM, COMPUTE, Action, ActionKind, Schedule, ScheduleError
from syncline.schedule.plan import DRAIN, SINGLE, START, STEADY, Plan, Segment
from syncline.schedule.validate import validate

__all__ = [
    "STREAM_MODELS",
    "align_receives",
    "check_nccl_order",
    "nccl_plan",
    "p2p_batches",
    "receive_before_recompute",
]

#: the stream models :func:`check_nccl_order` replays (see the module docstring)
STREAM_MODELS = ("pair", "rank")

K = ActionKind
#: a RECV kind -> the SEND kind it takes, and the sender's stage offset
_SENDER = {K.RECV_F: (K.SEND_F, -1), K.RECV_B: (K.SEND_B, 1)}


def p2p_batches(actions: Sequence[Action]) -> list[tuple[int, int]]:
    """The ``batch_isend_irecv`` groups of one rank's actions: maximal runs of SEND/RECV.

    Returns half-open index ranges ``[i, j)`` into ``actions``, in order; each is a maximal
    run of consecutive SEND_F/RECV_F/SEND_B/RECV_B actions, and every one of those actions
    is in exactly one range. The runtime issues each range as one group when it reaches
    the range's first action.

    Example:
        >>> from syncline.schedule.ir import parse_action
        >>> p2p_batches([parse_action(t) for t in "0F0 0SEND_F0 0RECV_B0 0B0".split()])
        [(1, 3)]
    """
    out: list[tuple[int, int]] = []
    start: int | None = None
    for i, action in enumerate(actions):
        if action.kind in COMM:
            if start is None:
                start = i
        elif start is not None:
            out.append((start, i))
            start = None
    if start is not None:
        out.append((start, len(actions)))
    return out


def align_receives(schedule: Schedule) -> Schedule:
    """Move each RECV up to where its SEND is issued when every rank runs in lockstep.

    Each F/B/R takes one tick (as ``render_grid`` draws it); a message sent after a tick
    ``t`` action is received before the receiver's first F/B/R starting at ``t`` or
    later (never later than before its own consumer), after the sends already there, so
    it joins their :func:`p2p_batches` group: each step's sends and the receives of what the
    neighbours made in that step go out together, as torch's pipelining batches them. Sends
    and everything else keep their places; receives from one peer keep their order.

    Raises:
        ScheduleError: the schedule fails :func:`~syncline.schedule.validate` before or after.

    Example:
        >>> from syncline.schedule import add_communication, interleaved_1f1b
        >>> aligned = align_receives(add_communication(interleaved_1f1b(2, 4, 2)))
        >>> aligned.to_strings()[1].split()[6:12]
        ['3RECV_F0', '3F0', '3RECV_F1', '3B0', '3SEND_B0', '1RECV_F2']
    """
    validate(schedule)
    run = execute(schedule, lambda a: 1.0 if a.kind in COMPUTE else 0.0)
    sent: dict[Key, float] = {
        (a.kind, a.stage, a.microbatch, a.batch): end
        for rank, acts in schedule.actions.items()
        for a, (_, end) in zip(acts, run.times[rank], strict=True)
        if a.kind in (K.SEND_F, K.SEND_B)
    }
    rows: dict[int, list[Action]] = {}
    for rank, acts in schedule.actions.items():
        anchors = [i for i, a in enumerate(acts) if a.kind in COMPUTE]
        starts = [run.times[rank][i][0] for i in anchors]
        before: dict[int, list[Action]] = defaultdict(list)
        for i, a in enumerate(acts):
            if a.kind in _SENDER:
                kind, step = _SENDER[a.kind]
                at = bisect.bisect_left(starts, sent[(kind, a.stage + step, a.microbatch, a.batch)])
                before[anchors[min(at, bisect.bisect_right(anchors, i))]].append(a)
        rows[rank] = [
            b for i, a in enumerate(acts) if a.kind not in _SENDER for b in (*before[i], a)
        ]
    aligned = replace(schedule, actions=rows)
    validate(aligned)
    return aligned


def receive_before_recompute(actions: Sequence[Action]) -> list[Action]:
    """Move each RECV up past the RECOMPUTEs right before it (they need no message).

    ``add_communication`` puts a RECV_B after the recompute of its backward, which splits
    it from the sends before that recompute into a group of its own; moved up, the group
    structure is the one of the same schedule without recompute.

    Example:
        >>> from syncline.schedule.ir import parse_action
        >>> acts = [parse_action(t) for t in "0F1 0SEND_F1 0R0 0RECV_B0 0B0".split()]
        >>> " ".join(map(str, receive_before_recompute(acts)))
        '0F1 0SEND_F1 0RECV_B0 0R0 0B0'
    """
    out: list[Action] = []
    for a in actions:
        at = len(out)
        while a.kind in _SENDER and at and out[at - 1].kind is K.RECOMPUTE:
            at -= 1
        out.insert(at, a)
    return out


def nccl_plan(plan: Plan) -> Plan:
    """``plan``, or the first of its rewrites that :func:`check_nccl_order` proves safe.

    Tried in order: the plan itself (GPipe, 1F1B, 2BW without recompute come back as they
    are); :func:`receive_before_recompute` on every call (2BW with recompute); for a flush
    plan, :func:`align_receives` (interleaved 1F1B). The runtime issues the result with
    :func:`p2p_batches`, so it never runs an order the replay has not proved.

    Raises:
        ScheduleError: none is safe (the replay's report of the last one tried).

    Example:
        >>> from syncline.schedule import build_plan
        >>> plan = build_plan("1f1b", num_ranks=2, num_stages=2, num_microbatches=4)
        >>> nccl_plan(plan) is plan
        True
    """
    error = ScheduleError(f"{plan.name}: no order to try")
    for rewrite in (lambda p: p, _hoisted, _aligned):
        candidate = rewrite(plan)
        if candidate is None:
            continue
        try:
            check_nccl_order(candidate)
            return candidate
        except ScheduleError as failed:
            error = failed
    raise error


def _hoisted(plan: Plan) -> Plan | None:
    """``plan`` with :func:`receive_before_recompute` on every call; ``None`` if the same."""
    rows = {k: _rows(s.actions, receive_before_recompute) for k, s in plan.segments.items()}
    if rows == {k: _rows(s.actions, list) for k, s in plan.segments.items()}:
        return None
    schedule = plan.schedule
    schedule = replace(schedule, actions=_rows(schedule.actions, receive_before_recompute))
    segments = {k: replace(s, actions=rows[k]) for k, s in plan.segments.items()}
    return Plan(plan.name, schedule, segments)


def _aligned(plan: Plan) -> Plan | None:
    """A flush plan with :func:`align_receives`; ``None`` for a plan never flushed."""
    if plan.overlapping:
        return None
    aligned = align_receives(plan.schedule)
    return Plan(plan.name, aligned, {SINGLE: Segment(SINGLE, aligned.actions, 0)})


def _rows(
    actions: Mapping[int, Sequence[Action]], rewrite: Callable[[Sequence[Action]], list[Action]]
) -> dict[int, tuple[Action, ...]]:
    return {r: tuple(rewrite(acts)) for r, acts in actions.items()}


def check_nccl_order(
    plan: Plan,
    *,
    replicas: int = 1,
    streams: Sequence[str] = STREAM_MODELS,
    eager: bool = False,
    grouping: Grouping = p2p_batches,
    kinds: Sequence[str] | None = None,
) -> None:
    """Replay ``plan`` on every rank under NCCL's rules (module docstring); raise if it hangs.

    Args:
        plan: a plan from :func:`~syncline.schedule.build_plan` (SEND/RECV included).
        replicas: data-parallel copies of the pipeline; rank ``position * replicas +
            replica``, as ``PipelineLayout``; a stage's REDUCE is a barrier of its copies.
        streams: the stream models to replay, of :data:`STREAM_MODELS`.
        eager: every send completes without its receive (small messages). By default each
            waits for its receive (over NCCL's eager threshold), the worst case. The loss
            is always eager.
        grouping: how a rank groups its SEND/RECV: :func:`p2p_batches` (the runtime's rule);
            one group per action replays the runtime that issued single isend/irecv calls.
        kinds: the calls replayed, call ``i`` finishing batch ``i``; by default ``start,
            steady x3, drain, single`` for 2BW and ``single, single`` otherwise.

    Raises:
        ScheduleError: a hang (each blocked host's step, what it waits for, and each
            stream's head group); messages NCCL would pair wrongly, since it pairs in issue
            order; or a ``grouping`` that breaks :func:`p2p_batches`'s contract.
        ConfigError: ``replicas``, ``streams`` or ``kinds`` is invalid, naming it.

    Example:
        >>> from syncline.schedule import build_plan
        >>> plan = build_plan("1f1b", num_ranks=2, num_stages=2, num_microbatches=4)
        >>> check_nccl_order(plan, replicas=2)
        >>> def singles(acts):  # one group per SEND/RECV, as the runtime issued them
        ...     comm = [i for i, a in enumerate(acts) if a.kind.name.startswith(("SEND", "RECV"))]
        ...     return [(i, i + 1) for i in comm]
        >>> try:
        ...     check_nccl_order(plan, grouping=singles)
        ... except ScheduleError as error:
        ...     print(str(error).splitlines()[1])
          rank 0, call 0 (single): at 0B0@b0: needs its RECV_B
    """
    kinds = _check_args(plan, replicas, streams, kinds)
    built = Builder(plan, kinds, replicas, eager).build(grouping)
    sends = "eager" if eager else "rendezvous"
    for model in streams:
        replay = Replay(built, model)
        if not replay.run():
            header = (
                f"{plan.name}: NCCL deadlock with {model!r} streams and {sends} sends, "
                f"calls {', '.join(kinds)}, replicas={replicas}:"
            )
            raise ScheduleError(explain(replay, header))


def _check_args(
    plan: Plan, replicas: int, streams: Sequence[str], kinds: Sequence[str] | None
) -> tuple[str, ...]:
    """Validate the arguments; the calls to replay."""
    check_int("replicas", replicas)
    if isinstance(streams, str) or not streams or not set(streams) <= set(STREAM_MODELS):
        raise ConfigError(f"streams={streams!r} must be a non-empty list of {STREAM_MODELS}")
    if kinds is None:
        overlapping = (START, STEADY, STEADY, STEADY, DRAIN, SINGLE)
        return overlapping if plan.overlapping else (SINGLE, SINGLE)
    unknown = [k for k in kinds if k not in plan.segments]
    if unknown or not kinds:
        raise ConfigError(
            f"kinds={list(kinds)!r}: {plan.name} has the calls {sorted(plan.segments)}"
        )
    return tuple(kinds)
