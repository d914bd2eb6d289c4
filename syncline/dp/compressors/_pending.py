"""Compose collectives into one :class:`Pending`, in an order every rank repeats.

Two jobs, both about *when* a collective is issued:

* :func:`chain` waits for several collectives, then runs the local decompression.
* :class:`PhaseOrder` schedules the second collective of a two-phase reduction (CSC: scores,
  then payload; PowerSGD: ``P``, then ``Q``), whose size or content depends on the first.

Why a rule rather than "launch phase two when phase one is done": gloo (like NCCL) matches
collectives by issue order, so every rank must issue them in the same sequence. Whether a
collective *happens to be finished* differs from rank to rank, so it must never decide the
order. :class:`PhaseOrder` decides from call order alone, which the engine makes identical on
every rank (``reduce`` per bucket during backward, then ``wait`` per bucket, in bucket order):

* ``submit(b)`` issues bucket ``b``'s first collective, *then* finishes phase one of every
  earlier bucket still waiting (blocking on its small first collective) and issues its second.
* ``wait(b)`` does the same for every bucket up to ``b`` that is still waiting, then waits
  for ``b``'s second collective and runs its decompression.

Timeline on one rank (``s`` = phase one, ``p`` = phase two; each hook is one bucket ready)::

    backward  hook0      hook1          hook2          end of backward
    issues    s0         s1, p0         s2, p1         p2 ; wait p0, p1, p2
    blocks    -          s0 done        s1 done        everything

``s(b)`` is issued before ``p(b-1)``, so waiting for it in hook ``b+1`` queues only behind
``p(b-2)``: the payload of a bucket overlaps the backward of the next two, and backward
stalls only when communication falls that far behind (when it is the bottleneck anyway).

**With a second lane** (a collective with a ``lane``: another process group of the same
ranks, :func:`syncline.comm.collectives.with_lane`) no hook blocks. Every phase one is issued
on the main group and every phase two on the lane, each group's in bucket order, so *when* a
rank issues a phase two no longer decides *which* collective it meets on the other ranks.
:meth:`PhaseOrder.poll` (called from every gradient hook) issues the waiting phase twos whose
phase one is done, in submit order, and stops at the first that is not: a slow link makes
phase two wait, never backward. Measured on two gloo ranks at 100 Mbit/s with small buckets,
blocking for ``s(b-1)`` in hook ``b`` stalled backward once per bucket.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from syncline.comm.collectives import Collective, Pending


def chain(
    parts: Sequence[Pending], finish: Callable[[], None], what: str, comm: Collective
) -> Pending:
    """One :class:`Pending` that waits for ``parts`` in order, then runs ``finish``.

    ``wire_bytes`` is the sum of the parts' (what the collectives reported putting on the wire).
    """

    def then() -> None:
        for part in parts:
            part.wait()
        finish()

    return Pending(
        works=[],
        what=what,
        timeout_s=comm.timeout_s,
        rank=comm.rank,
        then=then,
        wire_bytes=sum(p.wire_bytes for p in parts),
        deps=list(parts),
    )


@dataclass
class _Stage:
    first: Pending
    launch_second: Callable[[Collective], Pending]
    outer: Pending
    comm: Collective  # where phase two goes: the main group's collective, or its lane
    laned: bool  # phase two goes on a lane: issued by poll() once phase one is done
    second: Pending | None = None


class PhaseOrder:
    """Issues the second phase of each two-phase bucket in a rank-independent order.

    One instance per compressor; see the module docstring for the rule and its timeline.
    """

    def __init__(self) -> None:
        self._waiting: list[_Stage] = []  # phase two not issued yet, in submit order
        #: phase twos issued by :meth:`poll` (with a lane): before anything waited for them
        self.issued_by_poll = 0

    def single(self) -> None:
        """Call right after issuing a one-collective bucket: advance the earlier buckets
        (without a lane; with one, only those whose phase one is done)."""
        if self._lane_mode():
            self.poll()
        else:
            self._advance_all()

    def poll(self) -> None:
        """With a lane: issue, in submit order, every waiting phase two whose phase one is
        done, stopping at the first that is not. Never blocks. Without a lane: nothing (the
        order is then decided by :meth:`submit` and ``wait`` alone)."""
        while self._lane_mode() and self._waiting[0].first.is_done():
            self._advance(self._waiting.pop(0))
            self.issued_by_poll += 1

    def _lane_mode(self) -> bool:
        return bool(self._waiting) and self._waiting[0].laned

    def submit(
        self,
        first: Pending,
        launch_second: Callable[[Collective], Pending],
        finish: Callable[[], None],
        what: str,
        comm: Collective,
    ) -> Pending:
        """Register a bucket whose ``first`` collective was just issued on ``comm``.

        Args:
            first: the phase-one collective, already issued.
            launch_second: run once ``first`` is done with the collective to issue phase
                two on (``comm``'s lane if it has one, else ``comm``); returns phase two.
            finish: run once phase two is done (decompression into the gradient).
            what: description of the whole reduction, for errors.
            comm: the collective phase one went on.

        Returns:
            A :class:`Pending` whose ``wire_bytes`` grows by phase two's once it is issued.
        """
        outer = Pending(
            works=[],
            what=what,
            timeout_s=first.timeout_s,
            rank=first.rank,
            wire_bytes=first.wire_bytes,
        )
        lane: Collective | None = getattr(comm, "lane", None)
        stage = _Stage(
            first, launch_second, outer, comm if lane is None else lane, lane is not None
        )
        if lane is None:
            self._advance_all()
        self._waiting.append(stage)
        if lane is not None:
            self.poll()

        def then() -> None:
            while stage.second is None:
                self._advance(self._waiting.pop(0))
            stage.second.wait()
            finish()

        outer.then = then
        return outer

    def _advance_all(self) -> None:
        while self._waiting:
            self._advance(self._waiting.pop(0))

    @staticmethod
    def _advance(stage: _Stage) -> None:
        stage.first.wait()
        stage.second = stage.launch_second(stage.comm)
        stage.outer.wire_bytes += stage.second.wire_bytes
