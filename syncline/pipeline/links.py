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

Inferred shapes (:mod:`syncline.pipeline.shapes`), on the grouped (NCCL) path: where the
stages' forwards can be run without data, every rank knows each activation's shape for a
signature before any message, so no activation carries a header at all; a stage whose real
output differs from the inferred one is refused (:class:`~syncline.errors.ConfigError`)
before it sends. Where they cannot (a forward that reads values), the headers above learn
the shapes. gloo keeps the headers: it needs no inference, whose forward on fake tensors
runs the modules' forward hooks once more per signature.

Two ways to move the messages, chosen by backend:

- gloo (``early``): receives are posted early, because gloo moves a message only into a
  posted buffer (a late receive pays the whole transfer): a call posts its activations at
  its start (the payload when the shape is known, else the header, then the payload as soon
  as the header is in, polled between actions), and a SEND_F posts the buffer of the
  gradient that will come back.
- any other backend, NCCL (``grouped``): NCCL matches messages in posting order per pair of
  ranks, not by tag, and a large send waits for its receive, so each maximal run of
  SEND/RECV actions (:func:`syncline.schedule.nccl.p2p_batches`) goes out as ONE group at
  its first action, in schedule order (:meth:`Links.issue`), and a received tensor is waited
  for only when the compute that needs it runs. Messages sent in one call and received in
  the next (2BW starts the next batch's first forwards) are posted by their receiver before
  its first REDUCE (:meth:`Links.post_ahead`), in the sender's order, so that the tied
  gradients' and the loss's messages, an evaluation's, or the next call's, come after them
  on the pair as they do on the sender. Without inferred shapes, a header received in a
  group is read on the host before the rest of the group is issued (a host sync, only on
  the first batches of each signature: once the shape is settled no header is sent).

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
from collections.abc import Callable, Mapping, Sequence

import torch

from syncline import comm
from syncline.comm.collectives import Pending
from syncline.comm.p2p import Op, PointToPoint, Receive, empty_header, encode_header
from syncline.errors import ConfigError
from syncline.schedule import Action, ActionKind, Schedule

K = ActionKind
SENDS = frozenset({K.SEND_F, K.SEND_B})
RECVS = frozenset({K.RECV_F, K.RECV_B})
TAG_BASE = 1 << 24
LOSS_TAG = TAG_BASE - 4
_LOSS_LIKE = ((1,), torch.float64)
Like = tuple[tuple[int, ...], torch.dtype]
#: shape and dtype of the micro-batch input (stage 0's) that an activation was computed from
Signature = tuple[tuple[int, ...], torch.dtype]
#: ``infer(edge, signature)``: what stage ``edge`` sends for ``signature``, if inferable
Infer = Callable[[int, Signature], Like | None]
#: a SEND action's message and, for a SEND_F, the shape of the gradient that comes back
Outgoing = Mapping[Action, tuple[torch.Tensor, Like | None]]


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
    """Sends and receives of one rank's SEND/RECV actions (see the module docstring).

    Args:
        p2p: the point-to-point layer over the pipeline's group.
        schedule: gives the rank of each stage.
        num_microbatches: m, for the tags.
        early: post receives ahead of their RECV (gloo); ``False`` posts in order.
        signature: the input signature of an action's micro-batch (see the module
            docstring); the same on every rank.
        infer: ``infer(edge, signature)``, the inferred message of a boundary, ``None``
            where it cannot be inferred (then headers carry it); ``None``: never inferred.
        grouped: issue each run of SEND/RECV actions as one group (any backend but gloo).
    """

    def __init__(
        self,
        p2p: PointToPoint,
        schedule: Schedule,
        num_microbatches: int,
        *,
        early: bool,
        signature: Callable[[Action], Signature],
        infer: Infer | None = None,
        grouped: bool = False,
    ) -> None:
        self._p2p = p2p
        self._schedule = schedule
        self._d, self._m = schedule.num_stages, num_microbatches
        self.early = early and not grouped
        self.grouped = grouped
        self.infer = infer
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

    def use_grouped(self, *, ordered: bool = True) -> None:
        """Run the NCCL protocol on any backend (tests on gloo): groups, nothing posted
        early, and with ``ordered`` one wire tag, so that gloo matches messages in posting
        order per pair, as NCCL does (:mod:`syncline.comm.p2p`)."""
        self.grouped, self.early = True, False
        self._p2p.ordered = ordered

    def connect(self) -> None:
        """One collective over the pipeline's group before its first group of sends and
        receives: torch requires every rank of a group to take part in a
        ``batch_isend_irecv`` that is the group's first collective under NCCL."""
        flat = comm.FlatAllreduce(self._p2p.group, timeout_s=self._p2p.timeout_s)
        what = "pipeline group's first collective (before its point-to-point groups)"
        flat.allreduce(torch.zeros(1, device=self._p2p.device), what).wait()

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
        way = "to" if a.kind in SENDS else "from"
        return f"{a.kind.name} mb {a.microbatch} of step {a.batch} {way} rank {self.peer(a)} ({a})"

    @staticmethod
    def key(a: Action) -> tuple[ActionKind, int, int, int]:
        assert a.batch is not None and a.microbatch is not None
        return (a.kind, a.stage, a.batch, a.microbatch)

    # -- shapes ------------------------------------------------------------------------------

    def _inferred(self, edge: int, a: Action) -> Like | None:
        """The inferred message (grouped only: gloo learns shapes from headers, as before,
        and runs no forward on fake tensors, whose hooks would fire once more)."""
        if self.infer is None or not self.grouped:
            return None
        return self.infer(edge, self._signature(a))

    def _activation_like(self, a: Action) -> Like | None:
        """A RECV_F's shape, if known without a header: inferred, or settled by headers."""
        assert a.batch is not None
        inferred = self._inferred(a.stage - 1, a)
        if inferred is not None:
            return inferred
        return self.shapes.known(a.stage - 1, self._signature(a), a.batch)

    def _send_header(self, a: Action, like: Like) -> bool:
        """Check a SEND_F's real message against the inferred one and note it; returns
        whether it goes with a header (neither inferred nor settled).

        Raises:
            ConfigError: the message differs from the inferred one (the receiver posted a
                buffer of that shape), or from the one an earlier batch sent.
        """
        assert a.batch is not None
        signature = self._signature(a)
        inferred = self._inferred(a.stage, a)
        if inferred is not None and inferred != like:
            raise ConfigError(
                f"stage {a.stage} output {_fmt(like)} for micro-batch inputs {_fmt(signature)} "
                f"in step {a.batch}, but its forward run on the shapes alone gave "
                f"{_fmt(inferred)} (syncline.pipeline.shapes), which the next stage expects; "
                "a pipeline stage's output shape must follow from the shape of the micro-batch "
                "inputs, not from their values"
            )
        header = inferred is None and self.shapes.known(a.stage, signature, a.batch) is None
        self.shapes.learn(a.stage, signature, like, a.batch)
        return header

    # -- gloo: posted early, one message at a time ----------------------------------------------

    def expect_call(self, actions: list[Action]) -> None:
        """Post the receives of a call's activations: the payload where the shape is
        known, else the header (a few bytes)."""
        if self.early:
            for a in actions:
                if a.kind is K.RECV_F:
                    self._post(a, self._activation_like(a))

    def _post(self, a: Action, like: Like | None) -> None:
        handle = self._p2p.expect(self.peer(a), tag=self.tag(a), what=self.what(a), like=like)
        self._posted[self.key(a)] = handle

    def progress(self) -> None:
        """Post the payload of every activation whose header has arrived (never blocks)."""
        for handle in self._posted.values():
            if handle.payload is None:
                self._p2p.progress(handle)

    def recv(self, a: Action) -> torch.Tensor:
        """The tensor of a RECV_F or RECV_B; blocks (grouped: the current stream waits),
        with the p2p layer's timeout."""
        key = self.key(a)
        posted = self._posted.pop(key, None)
        like = None
        if posted is None:
            if self.grouped:
                raise RuntimeError(f"{self.what(a)}: no receive was issued for it")
            forward = a.kind is K.RECV_F
            like = self._activation_like(a) if forward else self._grad_like.pop(key[1:])
        tensor = self._p2p.recv(
            self.peer(a), tag=self.tag(a), what=self.what(a), like=like, expected=posted
        )
        if a.kind is K.RECV_F:
            assert a.batch is not None
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
        header = forward and self._send_header(a, like)
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

    # -- NCCL: one group per run of SEND/RECV actions -------------------------------------------

    def issue(self, actions: Sequence[Action], outgoing: Outgoing, call: int) -> None:
        """Issue a run of SEND/RECV actions as one group (see the module docstring): the
        sends (``outgoing``: each SEND's message) and the receives not posted ahead. The
        received tensors are taken by :meth:`recv`; the group is finished by
        :meth:`wait_sends`."""
        ops: list[Op] = []
        for a in actions:
            if a.kind in SENDS:
                ops.extend(self._send_ops(a, *outgoing[a]))
        receives = [a for a in actions if a.kind in RECVS and self.key(a) not in self._posted]
        self._receive(receives, ops, call, actions)

    def post_ahead(self, receives: Sequence[Action], call: int) -> None:
        """Post now the receives of messages already sent to this rank for a later call
        (in the order their sender sent them); :meth:`issue` then skips them."""
        todo = [a for a in receives if self.key(a) not in self._posted]
        if todo:
            self._receive(todo, [], call, todo)

    def _send_ops(self, a: Action, tensor: torch.Tensor, grad_like: Like | None) -> list[Op]:
        payload = tensor.detach().contiguous()
        forward = a.kind is K.SEND_F
        like = (tuple(payload.shape), payload.dtype)
        tag, peer = self.tag(a), self.peer(a)
        ops = [Op(True, payload, peer, tag)]
        if forward and self._send_header(a, like):
            ops.insert(0, Op(True, encode_header(payload, tag), peer, tag, header=True))
        self.sent["activations" if forward else "gradients"] += payload.nbytes
        if forward:
            assert a.batch is not None and a.microbatch is not None
            back = like if grad_like is None else grad_like
            self._grad_like[(a.stage, a.batch, a.microbatch)] = back
        return ops

    def _receive(
        self, receives: Sequence[Action], ops: list[Op], call: int, actions: Sequence[Action]
    ) -> None:
        """Add the ``receives`` to ``ops`` and issue them as one group. A receive of unknown
        shape (no inferred shape, not settled yet) cuts it: the ops so far and its header go
        as one group, the header is read on the host (a sync), and the rest follows."""
        what = "point-to-point group " + " ".join(str(a) for a in actions)
        waiting: list[Receive] = []
        for a in receives:
            handle = Receive(self.peer(a), self.tag(a), self.what(a))
            like = (
                self._activation_like(a)
                if a.kind is K.RECV_F
                else self._grad_like.pop(self.key(a)[1:])
            )
            if like is None:
                handle.header = empty_header(self._p2p.device)
                ops.append(Op(False, handle.header, handle.src, handle.tag, header=True))
                cut = self._issue_ops(ops, waiting, call, what)
                cut.wait()
                dtype, shape = self._p2p.read_header(handle)
                like, ops, waiting = (shape, dtype), [], []
            handle.payload = torch.empty(like[0], dtype=like[1], device=self._p2p.device)
            ops.append(Op(False, handle.payload, handle.src, handle.tag))
            waiting.append(handle)
            self._posted[self.key(a)] = handle
        self._issue_ops(ops, waiting, call, what)

    def _issue_ops(self, ops: list[Op], handles: list[Receive], call: int, what: str) -> Pending:
        pending = self._p2p.batch(ops, what)
        for handle in handles:
            handle.batch = pending
        self.hold(call, pending)
        return pending

    # -- the loss --------------------------------------------------------------------------------

    def expect_loss(self, batch: int, src: int) -> None:
        """Post the receive of ``batch``'s loss from the last stage's rank ``src`` (gloo)."""
        if self.early and batch not in self._loss_posted:
            self._loss_posted[batch] = self._p2p.expect(
                src, tag=LOSS_TAG + batch % 4, what=f"loss of step {batch}", like=_LOSS_LIKE
            )

    def send_loss(self, value: torch.Tensor, batch: int, call: int) -> None:
        """Send ``batch``'s loss (a float64 ``[1]`` on the device) from the last stage to
        every other rank."""
        tag = LOSS_TAG + batch % 4
        others = [dst for dst in range(self._schedule.num_ranks) if dst != self._p2p.rank]
        if self.grouped:
            ops = [Op(True, value, dst, tag) for dst in others]
            self.hold(call, self._p2p.batch(ops, f"loss of step {batch} to ranks {others}"))
            return
        for dst in others:
            what = f"loss of step {batch} to rank {dst}"
            self.hold(call, self._p2p.send(value, dst, tag=tag, what=what, header=False))

    def recv_loss(self, batch: int, src: int) -> torch.Tensor:
        """``batch``'s loss from rank ``src`` (on the device); blocks (grouped: the current
        stream waits), with the p2p layer's timeout."""
        tag, what = LOSS_TAG + batch % 4, f"loss of step {batch} from rank {src}"
        if self.grouped:
            value = torch.empty(_LOSS_LIKE[0], dtype=_LOSS_LIKE[1], device=self._p2p.device)
            self._p2p.batch([Op(False, value, src, tag)], what).wait()
            return value
        return self._p2p.recv(
            src, tag=tag, what=what, like=_LOSS_LIKE, expected=self._loss_posted.pop(batch, None)
        )

    def hold(self, call: int, pending: Pending) -> None:
        """Keep an operation started in ``call`` until :meth:`wait_sends` finishes it."""
        self._sends.append((call, pending))

    def wait_sends(self, call: int, *, everything: bool) -> None:
        """Finish the sends of calls before ``call`` (their receivers post them by the end of
        ``call``), or all of them."""
        while self._sends and (everything or self._sends[0][0] < call):
            self._sends.popleft()[1].wait()
