"""The messages of one rank's pipeline actions: tags, peers, early receives, pending sends.

Activations carry their shape (:mod:`syncline.comm.p2p`); gradients come without, since
they have the shape of the activation the receiver sent. Receives are posted early, because
gloo moves a message only into a posted buffer (a late receive pays the whole transfer):
a call posts the headers of its activations at its start, each payload as soon as its header
is in (polled between actions), and a SEND_F posts the buffer of the gradient that will come
back. NCCL matches messages in posting order, not by tag, so with any backend but gloo every
receive is posted when its RECV runs.

Tags are ``(batch mod 4, direction, edge, micro-batch)`` above ``TAG_BASE``: unique among
the messages in flight (2BW overlaps two batches at most) and apart from the small tags
(often 0) other users of the group send with.
"""

from __future__ import annotations

from collections import deque

import torch

from syncline.comm.collectives import Pending
from syncline.comm.p2p import PointToPoint, Receive
from syncline.schedule import Action, ActionKind, Schedule

K = ActionKind
TAG_BASE = 1 << 24
Like = tuple[tuple[int, ...], torch.dtype]


def max_tag(num_stages: int, num_microbatches: int) -> int:
    """The largest tag a pipeline of this size uses."""
    return TAG_BASE + 8 * num_stages * num_microbatches


class Links:
    """Sends and receives of one rank's SEND/RECV actions.

    Args:
        p2p: the point-to-point layer over the pipeline's group.
        schedule: gives the rank of each stage.
        num_microbatches: m, for the tags.
        early: post receives ahead of their RECV (gloo); ``False`` posts in order (NCCL).
    """

    def __init__(
        self, p2p: PointToPoint, schedule: Schedule, num_microbatches: int, *, early: bool
    ) -> None:
        self._p2p = p2p
        self._schedule = schedule
        self._d, self._m = schedule.num_stages, num_microbatches
        self.early = early
        self._posted: dict[tuple[ActionKind, int, int, int], Receive] = {}
        self._grad_like: dict[tuple[int, int, int], Like] = {}
        self._sends: deque[tuple[int, Pending]] = deque()

    def tag(self, a: Action) -> int:
        assert a.batch is not None and a.microbatch is not None
        backward = a.kind in (K.SEND_B, K.RECV_B)
        edge = a.stage if a.kind in (K.SEND_F, K.RECV_B) else a.stage - 1
        return TAG_BASE + (((a.batch % 4) * 2 + backward) * self._d + edge) * self._m + a.microbatch

    def peer(self, a: Action) -> int:
        other = a.stage + (1 if a.kind in (K.SEND_F, K.RECV_B) else -1)
        return self._schedule.rank_of(other)

    def what(self, a: Action) -> str:
        """E.g. ``"RECV_F mb 3 of step 7 from rank 0 (1RECV_F3@b7)"``, for errors."""
        way = "to" if a.kind in (K.SEND_F, K.SEND_B) else "from"
        return f"{a.kind.name} mb {a.microbatch} of step {a.batch} {way} rank {self.peer(a)} ({a})"

    def expect_call(self, actions: list[Action]) -> None:
        """Post the header receives of a call's activations (a few bytes each)."""
        if self.early:
            for a in actions:
                if a.kind is K.RECV_F:
                    self._post(a, None)

    def _post(self, a: Action, like: Like | None) -> None:
        assert a.batch is not None and a.microbatch is not None
        handle = self._p2p.expect(self.peer(a), tag=self.tag(a), what=self.what(a), like=like)
        self._posted[(a.kind, a.stage, a.batch, a.microbatch)] = handle

    def progress(self) -> None:
        """Post the payload of every activation whose header has arrived (never blocks)."""
        for handle in self._posted.values():
            if handle.payload is None:
                self._p2p.progress(handle)

    def recv(self, a: Action) -> torch.Tensor:
        """The tensor of a RECV_F or RECV_B; blocks, with the p2p layer's timeout."""
        assert a.batch is not None and a.microbatch is not None
        key = (a.kind, a.stage, a.batch, a.microbatch)
        posted = self._posted.pop(key, None)
        like = self._grad_like.pop(key[1:]) if a.kind is K.RECV_B and posted is None else None
        return self._p2p.recv(
            self.peer(a), tag=self.tag(a), what=self.what(a), like=like, expected=posted
        )

    def send(self, a: Action, tensor: torch.Tensor, call: int) -> None:
        """Start a SEND_F or SEND_B; it is waited on by :meth:`wait_sends`."""
        assert a.batch is not None and a.microbatch is not None
        forward = a.kind is K.SEND_F
        pending = self._p2p.send(
            tensor, self.peer(a), tag=self.tag(a), what=self.what(a), header=forward
        )
        self.hold(call, pending)
        if forward:  # the gradient comes back with this shape
            like = (tuple(tensor.shape), tensor.dtype)
            if self.early:
                self._post(Action(a.stage, K.RECV_B, a.microbatch, batch=a.batch), like)
            else:
                self._grad_like[(a.stage, a.batch, a.microbatch)] = like

    def hold(self, call: int, pending: Pending) -> None:
        """Keep an operation started in ``call`` until :meth:`wait_sends` finishes it."""
        self._sends.append((call, pending))

    def wait_sends(self, call: int, *, everything: bool) -> None:
        """Finish the sends of calls before ``call`` (their receivers post them by the end of
        ``call``), or all of them."""
        while self._sends and (everything or self._sends[0][0] < call):
            self._sends.popleft()[1].wait()
