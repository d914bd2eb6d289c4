"""The messages of one rank's pipeline actions: tags, peers, early receives, pending sends.

Shapes: a gradient has the shape of the activation it belongs to, so it always travels
without a header. An activation's shape is learnt once per *input signature* (the shape and
dtype of the micro-batch fed to stage 0, which every rank knows, since every rank takes every
batch): the first activations of each signature on an edge carry a header
(:mod:`syncline.comm.p2p`), both sides note the shape in a :class:`ShapeBook`, and from two
batches later on both send and receive the bare payload. One message instead of two matters:
the receiver can post the payload buffer at once, while with a header it can post it only
after the header is in, which on a busy rank is the next action boundary (torch's
Schedule1F1B sends no headers either; the effect is in ``benchmarks/results/NOTES.md``). A
shorter last batch
or another sequence length is a new signature, so it goes with headers again; a stage whose
output shape depends on the data itself is refused with a clear error.

Receives are posted early, because gloo moves a message only into a posted buffer (a late
receive pays the whole transfer): a call posts its activations at its start (the payload
when the shape is known, else the header, then the payload as soon as the header is in,
polled between actions), and a SEND_F posts the buffer of the gradient that will come back.
NCCL matches messages in posting order, not by tag, so with any backend but gloo every
receive is posted when its RECV runs.

The batch loss goes from the last stage to every other rank as one small message each
(:meth:`Links.send_loss`); with gloo its receive is posted when the call starts, so the
value lands while this rank still computes and the call's end does not wait a round trip
for it (a broadcast is posted only when every rank reaches it).

Tags are ``(batch mod 4, direction, edge, micro-batch)`` above ``TAG_BASE``: unique among
the messages in flight (2BW overlaps two batches at most) and apart from the small tags
(often 0) other users of the group send with; the loss takes ``LOSS_TAG + batch mod 4``,
just below them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from syncline.comm.collectives import Pending
from syncline.comm.p2p import PointToPoint, Receive
from syncline.errors import ConfigError
from syncline.schedule import Action, ActionKind, Schedule

K = ActionKind
TAG_BASE = 1 << 24
LOSS_TAG = TAG_BASE - 4
_LOSS_LIKE = ((1,), torch.float64)
Like = tuple[tuple[int, ...], torch.dtype]
#: shape and dtype of the micro-batch input (stage 0's) that an activation was computed from
Signature = tuple[tuple[int, ...], torch.dtype]


def max_tag(num_stages: int, num_microbatches: int) -> int:
    """The largest tag a pipeline of this size uses."""
    return TAG_BASE + 8 * num_stages * num_microbatches


def tied_tag(num_stages: int, group: int, batch: int, stage: int) -> int:
    """The tag of ``stage``'s gradient of tied weight ``group`` in ``batch``: below the
    loss's tags, unique per (group, batch mod 4, sender)."""
    return LOSS_TAG - 1 - ((group * 4 + batch % 4) * num_stages + stage)


class ShapeBook:
    """The activation shape each edge sends for each input signature, as learnt so far.

    A shape learnt from a message of batch ``b`` is used from batch ``b + LAG`` on. Both
    sides then decide alike: by the time a receiver posts the receives of batch ``b + LAG``
    it has finished batch ``b`` (2BW overlaps two batches at most), so it has read every
    header the sender sent up to then, and the sender has sent them all.
    """

    LAG = 2

    def __init__(self) -> None:
        self._book: dict[tuple[int, Signature], tuple[Like, int]] = {}

    def known(self, edge: int, signature: Signature, batch: int) -> Like | None:
        """The shape to send or receive without a header for ``batch``, if settled."""
        entry = self._book.get((edge, signature))
        return entry[0] if entry is not None and entry[1] <= batch - self.LAG else None

    def learn(self, edge: int, signature: Signature, like: Like, batch: int) -> None:
        """Note what ``edge`` sent for ``signature`` in ``batch``; the first note stays.

        Raises:
            ConfigError: the edge sent another shape for this signature before: the stage's
                output shape depends on the data, which headerless messages cannot follow.
        """
        first = self._book.setdefault((edge, signature), (like, batch))
        if first[0] != like:
            raise ConfigError(
                f"stage {edge} output {_fmt(like)} for micro-batch inputs {_fmt(signature)} "
                f"in step {batch}, but {_fmt(first[0])} for the same inputs in step "
                f"{first[1]}; a pipeline stage's output shape must follow from the shape of "
                "the micro-batch inputs, not from their values"
            )


def _fmt(like: Like) -> str:
    return f"{list(like[0])} {str(like[1]).removeprefix('torch.')}"


class Links:
    """Sends and receives of one rank's SEND/RECV actions.

    Args:
        p2p: the point-to-point layer over the pipeline's group.
        schedule: gives the rank of each stage.
        num_microbatches: m, for the tags.
        early: post receives ahead of their RECV (gloo); ``False`` posts in order (NCCL).
        signature: the input signature of an action's micro-batch (see the module
            docstring); the same on every rank.
    """

    def __init__(
        self,
        p2p: PointToPoint,
        schedule: Schedule,
        num_microbatches: int,
        *,
        early: bool,
        signature: Callable[[Action], Signature],
    ) -> None:
        self._p2p = p2p
        self._schedule = schedule
        self._d, self._m = schedule.num_stages, num_microbatches
        self.early = early
        self._signature = signature
        self.shapes = ShapeBook()
        self._posted: dict[tuple[ActionKind, int, int, int], Receive] = {}
        self._loss_posted: dict[int, Receive] = {}
        self._grad_like: dict[tuple[int, int, int], Like] = {}
        self._sends: deque[tuple[int, Pending]] = deque()
        #: payload bytes this rank sent, in all (shape headers and losses not counted)
        self.sent = {"activations": 0, "gradients": 0}

    @property
    def p2p(self) -> PointToPoint:
        return self._p2p

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
        """Post the receives of a call's activations: the payload where the shape is
        settled, else the header (a few bytes)."""
        if self.early:
            for a in actions:
                if a.kind is K.RECV_F:
                    self._post(a, self._activation_like(a))

    def _activation_like(self, a: Action) -> Like | None:
        assert a.batch is not None
        return self.shapes.known(a.stage - 1, self._signature(a), a.batch)

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
        like = None
        if posted is None:
            forward = a.kind is K.RECV_F
            like = self._activation_like(a) if forward else self._grad_like.pop(key[1:])
        tensor = self._p2p.recv(
            self.peer(a), tag=self.tag(a), what=self.what(a), like=like, expected=posted
        )
        if a.kind is K.RECV_F:
            like = (tuple(tensor.shape), tensor.dtype)
            self.shapes.learn(a.stage - 1, self._signature(a), like, a.batch)
        return tensor

    def send(
        self, a: Action, tensor: torch.Tensor, call: int, grad_like: Like | None = None
    ) -> None:
        """Start a SEND_F or SEND_B; it is waited on by :meth:`wait_sends`. A SEND_F posts
        the receive of the gradient that comes back, of shape ``grad_like`` (default: the
        activation's)."""
        assert a.batch is not None and a.microbatch is not None
        forward = a.kind is K.SEND_F
        like = (tuple(tensor.shape), tensor.dtype)
        header = False
        if forward:  # a header unless both sides know this shape already
            signature = self._signature(a)
            header = self.shapes.known(a.stage, signature, a.batch) is None
            self.shapes.learn(a.stage, signature, like, a.batch)
        pending = self._p2p.send(
            tensor, self.peer(a), tag=self.tag(a), what=self.what(a), header=header
        )
        self.hold(call, pending)
        self.sent["activations" if forward else "gradients"] += pending.wire_bytes
        if forward:  # the gradient comes back with this shape
            back = like if grad_like is None else grad_like
            if self.early:
                self._post(Action(a.stage, K.RECV_B, a.microbatch, batch=a.batch), back)
            else:
                self._grad_like[(a.stage, a.batch, a.microbatch)] = back

    def expect_loss(self, batch: int, src: int) -> None:
        """Post the receive of ``batch``'s loss from the last stage's rank ``src`` (gloo)."""
        if self.early and batch not in self._loss_posted:
            self._loss_posted[batch] = self._p2p.expect(
                src, tag=LOSS_TAG + batch % 4, what=f"loss of step {batch}", like=_LOSS_LIKE
            )

    def send_loss(self, value: torch.Tensor, batch: int, call: int) -> None:
        """Send ``batch``'s loss (a float64 ``[1]``) from the last stage to every other rank."""
        for dst in range(self._schedule.num_ranks):
            if dst != self._p2p.rank:
                what = f"loss of step {batch} to rank {dst}"
                pending = self._p2p.send(
                    value, dst, tag=LOSS_TAG + batch % 4, what=what, header=False
                )
                self.hold(call, pending)

    def recv_loss(self, batch: int, src: int) -> torch.Tensor:
        """``batch``'s loss from rank ``src``; blocks, with the p2p layer's timeout."""
        return self._p2p.recv(
            src,
            tag=LOSS_TAG + batch % 4,
            what=f"loss of step {batch} from rank {src}",
            like=_LOSS_LIKE,
            expected=self._loss_posted.pop(batch, None),
        )

    def hold(self, call: int, pending: Pending) -> None:
        """Keep an operation started in ``call`` until :meth:`wait_sends` finishes it."""
        self._sends.append((call, pending))

    def wait_sends(self, call: int, *, everything: bool) -> None:
        """Finish the sends of calls before ``call`` (their receivers post them by the end of
        ``call``), or all of them."""
        while self._sends and (everything or self._sends[0][0] < call):
            self._sends.popleft()[1].wait()
