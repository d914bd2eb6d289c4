"""PURE: the NCCL replay behind :func:`syncline.schedule.nccl.check_nccl_order`.

Two parts: :class:`Builder` turns a plan's calls into host programs (launch a group, wait for
operations, meet at a barrier) over numbered operations and groups, pairing each send with
its receive in issue order as NCCL does; :class:`Replay` runs those programs against FIFO
streams of groups until nothing can move, and :func:`explain` prints where it stuck.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from itertools import zip_longest
from typing import NamedTuple

from syncline.schedule.ir import COMM, Action, ActionKind, ScheduleError
from syncline.schedule.plan import DRAIN, SINGLE, Plan

K = ActionKind
_LAUNCH, _NEED, _BARRIER, _WAIT = range(4)
_FLUSHING = frozenset({DRAIN, SINGLE})  # calls whose end waits for every send
_SENDS = frozenset({K.SEND_F, K.SEND_B})
_NEEDS = {K.FORWARD: "needs its RECV_F", K.BACKWARD: "needs its RECV_B"}

#: one rank's actions -> the half-open index ranges it issues as groups
Grouping = Callable[[Sequence[Action]], list[tuple[int, int]]]
#: a message as both sides name it: (direction, from stage, to stage, micro-batch, batch)
Message = tuple[str, int, int, int, int]
#: a stream: (rank, peer), the peer -1 in the "rank" model
Stream = tuple[int, int]


@dataclass
class _Op:
    """One send or receive of one rank, as NCCL sees it."""

    rank: int
    peer: int
    send: bool
    eager: bool  # the message is small: its send completes without the receive
    message: Message
    group: int
    call: int
    action: Action | None  # as in the plan (batch relative); None for the loss
    partner: int = -1

    @property
    def what(self) -> str:
        a, batch = self.action, self.message[4]
        name = f"loss@b{batch}" if a is None else str(replace(a, batch=batch))
        return f"{name} {'->' if self.send else '<-'} rank {self.peer}"


class _Step(NamedTuple):
    """One thing a host does: launch a group, wait for operations, or meet at a barrier."""

    code: int
    ids: tuple[int, ...]
    call: int
    label: str
    action: Action | None = None  # the F/B/REDUCE it belongs to, as in the plan
    offset: int = 0  # global batch = plan batch + offset (Segment.at)

    @property
    def what(self) -> str:
        if self.action is None:
            return self.label
        a, b = self.action, self.offset
        batch = b if a.batch is None else a.batch + b
        version = None if a.version is None else a.version + b
        return f"at {replace(a, batch=batch, version=version)}: {self.label}"


@dataclass
class Built:
    """Every rank's host program, and the operations and groups they launch."""

    kinds: Sequence[str]
    replicas: int
    ops: list[_Op] = field(default_factory=list)
    groups: list[list[int]] = field(default_factory=list)
    programs: dict[int, list[_Step]] = field(default_factory=dict)
    barriers: list[tuple[int, ...]] = field(default_factory=list)


class _Template(NamedTuple):
    """One rank's list in one segment, reduced to what the replay needs, built once.

    ``items`` in order: ``(_LAUNCH, c, e)`` launches the group ``comm[c:e]``; ``(_NEED, c,
    n)``: ``acts[n]`` needs the receive ``comm[c]``, so the whole group ``spans[c]`` (one
    kernel, one work: its operations finish together); ``(_BARRIER, -1, n)``: ``acts[n]``
    is a REDUCE.
    """

    acts: Sequence[Action]
    comm: list[Action]
    spans: list[tuple[int, int]]
    items: list[tuple[int, int, int]]


def _message(a: Action, offset: int) -> Message:
    assert a.microbatch is not None
    s, batch = a.stage, offset if a.batch is None else a.batch + offset
    src, dst = {K.SEND_F: (s, s + 1), K.RECV_F: (s - 1, s), K.SEND_B: (s, s - 1)}.get(
        a.kind, (s + 1, s)
    )
    return ("F" if a.kind in (K.SEND_F, K.RECV_F) else "B", src, dst, a.microbatch, batch)


def _check_ranges(acts: Sequence[Action], ranges: list[tuple[int, int]], where: str) -> None:
    """The grouping's contract: ordered, disjoint, non-empty runs covering every SEND/RECV."""
    covered: set[int] = set()
    end = 0
    for i, j in ranges:
        if not end <= i < j <= len(acts):
            raise ScheduleError(f"{where}: group [{i}, {j}) is empty, out of range or overlaps")
        bad = [str(a) for a in acts[i:j] if a.kind not in COMM]
        if bad:
            raise ScheduleError(f"{where}: group [{i}, {j}) holds non-p2p actions {bad}")
        covered.update(range(i, j))
        end = j
    missing = [str(a) for n, a in enumerate(acts) if a.kind in COMM and n not in covered]
    if missing:
        raise ScheduleError(f"{where}: p2p actions {missing} are in no group")


def _template(acts: Sequence[Action], grouping: Grouping, last: int, where: str) -> _Template:
    ranges = grouping(acts)
    _check_ranges(acts, ranges, where)
    ends = dict(ranges)
    comm: list[Action] = []
    spans: list[tuple[int, int]] = []
    items: list[tuple[int, int, int]] = []
    span = (0, 0)
    recvs: dict[tuple[ActionKind, int, int | None, int | None], int] = {}
    for n, a in enumerate(acts):
        if n in ends:
            span = (len(comm), len(comm) + ends[n] - n)
            items.append((_LAUNCH, *span))
        if a.kind in COMM:
            recvs[(a.kind, a.stage, a.microbatch, a.batch)] = len(comm)
            comm.append(a)
            spans.append(span)
        elif (a.kind is K.FORWARD and a.stage > 0) or (a.kind is K.BACKWARD and a.stage < last):
            recv = K.RECV_F if a.kind is K.FORWARD else K.RECV_B
            c = recvs.get((recv, a.stage, a.microbatch, a.batch), -1)
            if c < 0:
                raise ScheduleError(f"{where}: {a} has no {recv.name} before it")
            items.append((_NEED, c, n))
        elif a.kind is K.REDUCE:
            items.append((_BARRIER, -1, n))
    return _Template(acts, comm, spans, items)


class Builder:
    """Turns the plan's calls into host programs of launches, waits and barriers."""

    def __init__(self, plan: Plan, kinds: Sequence[str], replicas: int, eager: bool) -> None:
        self.plan, self.w, self.eager = plan, replicas, eager
        self.built = Built(kinds, replicas)
        self.last = plan.schedule.rank_of(plan.schedule.num_stages - 1)
        self._barrier_ids: dict[tuple[int, int, int], int] = {}
        self._templates: dict[tuple[str, int], _Template] = {}

    def build(self, grouping: Grouping) -> Built:
        """Every rank's program for the calls ``kinds``, sends paired with receives."""
        for p in range(self.plan.num_ranks):
            for k in range(self.w):
                g = p * self.w + k
                program = self.built.programs.setdefault(g, [])
                unwaited: list[int] = []
                for i, kind in enumerate(self.built.kinds):
                    self._call(g, i, self._template_of(kind, p, grouping), unwaited)
                    self._end_call(g, i, kind, unwaited)
                if unwaited:  # Pipeline.flush()
                    program.append(_Step(_WAIT, tuple(unwaited), i, "flush: waits for sends"))
        pair_up(self.built, self.plan.name)
        return self.built

    def _template_of(self, kind: str, p: int, grouping: Grouping) -> _Template:
        if (kind, p) not in self._templates:
            where = f"{self.plan.name}: rank {p} in a {kind!r} call"
            acts = self.plan.segments[kind].actions[p]
            last = self.plan.schedule.num_stages - 1
            self._templates[(kind, p)] = _template(acts, grouping, last, where)
        return self._templates[(kind, p)]

    def _group(self, g: int, call: int) -> int:
        self.built.groups.append([])
        gid = len(self.built.groups) - 1
        self.built.programs[g].append(_Step(_LAUNCH, (gid,), call, "launch"))
        return gid

    def _op(self, g: int, peer: int, send: bool, message: Message, a: Action | None) -> int:
        gid, call = len(self.built.groups) - 1, self.built.programs[g][-1].call
        eager = self.eager or a is None  # the loss is 8 bytes
        self.built.ops.append(_Op(g, peer, send, eager, message, gid, call, a))
        self.built.groups[gid].append(len(self.built.ops) - 1)
        return len(self.built.ops) - 1

    def _barrier(self, g: int, call: int, n: int, step: _Step) -> None:
        members = tuple(range(g - g % self.w, g - g % self.w + self.w))
        bid = self._barrier_ids.setdefault((members[0], call, n), len(self.built.barriers))
        if bid == len(self.built.barriers):
            self.built.barriers.append(members)
        self.built.programs[g].append(step._replace(ids=(bid,)))

    def _call(self, g: int, i: int, template: _Template, unwaited: list[int]) -> None:
        offset = i + self.plan.segments[self.built.kinds[i]].shift
        program, base, replica = self.built.programs[g], len(self.built.ops), g % self.w
        rank_of = self.plan.schedule.rank_of
        for code, c, n in template.items:
            if code == _LAUNCH:
                self._group(g, i)
                for a in template.comm[c:n]:
                    msg, send = _message(a, offset), a.kind in _SENDS
                    peer = rank_of(msg[2] if send else msg[1]) * self.w + replica
                    o = self._op(g, peer, send, msg, a)
                    if send:
                        unwaited.append(o)
            elif code == _NEED:
                a = template.acts[n]
                group = tuple(range(base + template.spans[c][0], base + template.spans[c][1]))
                program.append(_Step(_NEED, group, i, _NEEDS[a.kind], a, offset))
            elif self.w > 1:
                a = template.acts[n]
                self._barrier(g, i, n, _Step(_BARRIER, (), i, "waits for replicas", a, offset))

    def _end_call(self, g: int, i: int, kind: str, unwaited: list[int]) -> None:
        program, p, replica = self.built.programs[g], g // self.w, g % self.w
        ops = self.built.ops
        waits = [o for o in unwaited if kind in _FLUSHING or ops[o].call < i]
        if waits:
            program.append(_Step(_WAIT, tuple(waits), i, "end of call: waits for sends"))
            unwaited[:] = [o for o in unwaited if ops[o].call == i and kind not in _FLUSHING]
        if self.plan.num_ranks == 1:
            return
        loss: Message = ("L", -1, -1, 0, i)
        if p == self.last:
            if self.w > 1:
                self._barrier(g, i, -1, _Step(_BARRIER, (), i, f"loss@b{i} average: waits"))
            for q in range(self.plan.num_ranks):
                if q != p:
                    self._group(g, i)
                    unwaited.append(self._op(g, q * self.w + replica, True, loss, None))
        else:
            self._group(g, i)
            o = self._op(g, self.last * self.w + replica, False, loss, None)
            program.append(_Step(_WAIT, (o,), i, f"end of call: needs loss@b{i}"))


def pair_up(built: Built, name: str) -> None:
    """Match rank a's k-th send to b with b's k-th receive from a, as NCCL does."""
    channels: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
    for o, op in enumerate(built.ops):
        src, dst = (op.rank, op.peer) if op.send else (op.peer, op.rank)
        channels.setdefault((src, dst), ([], []))[0 if op.send else 1].append(o)
    for (src, dst), (sends, recvs) in channels.items():
        for n, (s, r) in enumerate(zip_longest(sends, recvs)):
            if s is None or r is None or built.ops[s].message != built.ops[r].message:
                said = "nothing" if s is None else built.ops[s].what
                heard = "nothing" if r is None else built.ops[r].what
                raise ScheduleError(
                    f"{name}: NCCL pairs the messages from rank {src} to rank {dst} in issue "
                    f"order, but message {n} is {said} on rank {src} and {heard} on rank {dst}"
                )
            built.ops[s].partner, built.ops[r].partner = r, s


class Replay:
    """Runs the host programs against NCCL's streams until nothing can move.

    Every condition that lets something move stays true once true (a group at the head of
    its streams stays there until done), so the order of the moves does not matter: each
    host runs as far as it can, then the groups and operations that became ready move.
    """

    def __init__(self, built: Built, model: str) -> None:
        self.b, self.model = built, model
        self.streams = [self._streams_of(ops) for ops in built.groups]
        self.fifos: dict[Stream, deque[int]] = defaultdict(deque)
        self.launched = [False] * len(built.groups)
        self.active = [False] * len(built.groups)
        self.left = [len(ops) for ops in built.groups]
        self.done = [False] * len(built.ops)
        self.pc = dict.fromkeys(built.programs, 0)
        self.arrived: list[set[int]] = [set() for _ in built.barriers]
        self.wake: deque[int] = deque(built.programs)
        self.todo: list[int] = []

    def _streams_of(self, ops: list[int]) -> tuple[Stream, ...]:
        rank = self.b.ops[ops[0]].rank
        if self.model == "rank":
            return ((rank, -1),)
        return tuple(sorted({(rank, self.b.ops[o].peer) for o in ops}))

    def run(self) -> bool:
        """Replay to the end; whether every host finished and every operation completed."""
        while self.wake:
            self._advance(self.wake.popleft())
            self._settle()
        finished = all(pc == len(self.b.programs[g]) for g, pc in self.pc.items())
        return finished and all(self.done)

    def _advance(self, g: int) -> None:
        program, pc = self.b.programs[g], self.pc[g]
        while pc < len(program):
            step = program[pc]
            if step.code == _LAUNCH:
                gid = step.ids[0]
                for stream in self.streams[gid]:
                    self.fifos[stream].append(gid)
                self.launched[gid] = True
                self.todo.append(gid)
            elif step.code == _BARRIER:
                arrived, members = self.arrived[step.ids[0]], self.b.barriers[step.ids[0]]
                if g not in arrived:
                    arrived.add(g)
                    if len(arrived) == len(members):
                        self.wake.extend(m for m in members if m != g)
                if len(arrived) < len(members):
                    break
            elif not all(self.done[o] for o in step.ids):
                break
            pc += 1
        self.pc[g] = pc

    def _at_head(self, gid: int) -> bool:
        return all(self.fifos[s] and self.fifos[s][0] == gid for s in self.streams[gid])

    def _settle(self) -> None:
        while self.todo:
            gid = self.todo.pop()
            if not self.active[gid] and self._at_head(gid):
                self.active[gid] = True
                for o in self.b.groups[gid]:
                    self._match(o)

    def _match(self, o: int) -> None:
        """Complete ``o`` (and its partner) if NCCL would now; ``o``'s group is active."""
        op = self.b.ops[o]
        if self.done[o]:
            return
        if op.eager:  # the send lands in the peer's buffer at once; the receive takes it
            if op.send:
                self._complete(o)
                if self.active[self.b.ops[op.partner].group]:
                    self._match(op.partner)
            elif self.done[op.partner]:
                self._complete(o)
        elif self.active[self.b.ops[op.partner].group]:  # rendezvous: both run, both end
            self._complete(o)
            self._complete(op.partner)

    def _complete(self, o: int) -> None:
        op = self.b.ops[o]
        self.done[o] = True
        self.wake.append(op.rank)
        self.left[op.group] -= 1
        if self.left[op.group] == 0:  # the group's kernel ends: the next one may start
            for stream in self.streams[op.group]:
                fifo = self.fifos[stream]
                assert fifo[0] == op.group
                fifo.popleft()
                if fifo:
                    self.todo.append(fifo[0])


def _queued(r: Replay, gid: int) -> str:
    """Where group ``gid`` stands: not issued, queued behind other heads, or running."""
    if not r.launched[gid]:
        return "not issued yet"
    if r.active[gid]:
        return "running"
    ahead = {r.fifos[s][0] for s in r.streams[gid] if r.fifos[s][0] != gid}
    return "queued behind " + ", ".join(_show(r, a) for a in sorted(ahead))


def _show(r: Replay, gid: int) -> str:
    return "[" + " ".join(r.b.ops[o].what.split(" ")[0] for o in r.b.groups[gid]) + "]"


def _pending(r: Replay, o: int) -> str:
    op = r.b.ops[o]
    if not r.active[op.group]:
        return f"{op.what}: {_queued(r, op.group)}"
    mate = r.b.ops[op.partner]
    return f"{op.what}: running, waits for {mate.what} ({_queued(r, mate.group)})"


def explain(r: Replay, header: str) -> str:
    """Each blocked host's step and what it waits for, then every stream's head group."""
    b, lines = r.b, [header]
    for g, pc in sorted(r.pc.items()):
        if pc == len(b.programs[g]):
            continue
        step = b.programs[g][pc]
        where = f" (pipeline rank {g // b.replicas}, replica {g % b.replicas})"
        where = where if b.replicas > 1 else ""
        lines.append(f"  rank {g}{where}, call {step.call} ({b.kinds[step.call]}): {step.what}")
        if step.code != _BARRIER:
            lines += [f"    {_pending(r, o)}" for o in step.ids if not r.done[o]]
    lines.append("  stream heads:")
    for (g, peer), fifo in sorted(r.fifos.items()):
        if fifo:
            name = f"rank {g} to {peer}" if peer >= 0 else f"rank {g}"
            more = f" (+{len(fifo) - 1} queued)" if len(fifo) > 1 else ""
            lines.append(f"    {name}: {_show(r, fifo[0])}{more}")
            head = [o for o in b.groups[fifo[0]] if not r.done[o]]
            lines += [f"      {_pending(r, o)}" for o in head]
    return "\n".join(lines)
