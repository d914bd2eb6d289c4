"""Point-to-point tensors between pipeline stages: shapes sent along, every wait bounded.

Protocol (one transfer = two messages on the same pair of ranks)::

    header   int64[4 + MAX_DIMS] = [MAGIC, tag, dtype code, ndim, dim0, dim1, ...]   tag 2t
    payload  the tensor's bytes, contiguous                                           tag 2t+1

The receiver waits for the header, allocates the payload from it, then waits for the payload,
so shapes may change from message to message (a shorter last batch, another sequence length)
with no per-step handshake. A receiver that knows the shape already (a gradient has the shape
of the activation it was sent for) skips the header: one message instead of two.

The caller picks the tag ``t`` so that every message in flight between two ranks has its own
(gloo matches by tag; NCCL ignores tags and matches in posting order, and then the tag echoed
in the header catches a mix-up at once instead of corrupting data). Every wait has a timeout
and fails with a :class:`~syncline.errors.CommError` that names this rank and ``what``
(e.g. ``"RECV_F mb 3 of step 7 from rank 0"``).

Batches (:meth:`PointToPoint.batch`): the sends and receives one rank issues at one point of
a schedule go out as ONE ``batch_isend_irecv`` group. Under NCCL all traffic between two
ranks shares one communicator, matched in issue order, and a send larger than NCCL's eager
buffer waits for its receive; two ranks whose next operations are both large sends to each
other (1F1B: rank 0's ``SEND_F`` of micro-batch 1, rank 1's ``SEND_B`` of micro-batch 0)
deadlock when each is issued alone, and do not when each rank's sends and receives launch
together (torch.distributed.pipelining does the same). NCCL coalesces a group into one
work, so waiting for any receive of a group waits for the whole group.

Waits go through :meth:`syncline.comm.collectives.Pending.wait`: on gloo the host waits at
most ``timeout_s``; under NCCL the current CUDA stream waits for the communication and the
host goes on (the process group's own timeout, its watchdog, bounds the wait there).

``ordered``: every message goes with one wire tag, so gloo matches messages in posting order
per pair of ranks, as NCCL does; tests run the NCCL protocol on gloo with it, where a
mismatch of orders fails (gloo aborts on a message of another size) instead of being hidden
by tags.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from syncline.comm.collectives import Pending
from syncline.comm.groups import Group, group_rank
from syncline.errors import CommError

__all__ = [
    "MAX_DIMS",
    "MAX_TAG",
    "Op",
    "PointToPoint",
    "Receive",
    "decode_header",
    "encode_header",
]

MAX_DIMS = 8
#: largest tag a caller may pass (the wire uses ``2 * tag + 1``; gloo tags are 32-bit)
MAX_TAG = (2**31 - 2) // 2
_MAGIC = 0x5C11
_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}


def encode_header(
    tensor: torch.Tensor, tag: int, device: torch.device | None = None
) -> torch.Tensor:
    """The header announcing ``tensor`` (see the module docstring).

    Raises:
        CommError: more than ``MAX_DIMS`` dimensions or an unsupported dtype.
    """
    if tensor.dim() > MAX_DIMS:
        raise CommError(f"cannot send a {tensor.dim()}-d tensor; at most {MAX_DIMS} dimensions")
    if tensor.dtype not in _CODE:
        raise CommError(f"cannot send dtype {tensor.dtype}; supported: {list(_CODE)}")
    dims = [*tensor.shape, *([0] * (MAX_DIMS - tensor.dim()))]
    values = [_MAGIC, tag, _CODE[tensor.dtype], tensor.dim(), *dims]
    return torch.tensor(values, dtype=torch.int64, device=device or tensor.device)


def decode_header(header: torch.Tensor, tag: int) -> tuple[torch.dtype, tuple[int, ...]]:
    """``(dtype, shape)`` from a header; checks it is one and that it carries ``tag``.

    Raises:
        CommError: not a header, or a message meant for another tag (the peers disagree on
            the order of messages).
    """
    values = header.tolist()
    magic, got_tag, code, ndim = values[:4]
    if magic != _MAGIC or not 0 <= code < len(_DTYPES) or not 0 <= ndim <= MAX_DIMS:
        raise CommError(f"received a malformed tensor header {values[:4]}")
    if got_tag != tag:
        raise CommError(f"expected the message with tag {tag}, received tag {got_tag}")
    return _DTYPES[code], tuple(values[4 : 4 + ndim])


@dataclass(frozen=True)
class Op:
    """One operation of a :meth:`PointToPoint.batch`.

    Attributes:
        send: ``True`` to send ``tensor`` to ``peer``, ``False`` to receive into it.
        tensor: the payload (contiguous), or the receive buffer.
        peer: the other rank, within the group.
        tag: as for :meth:`PointToPoint.send`.
        header: the shape header of message ``tag`` instead of its payload.
    """

    send: bool
    tensor: torch.Tensor
    peer: int
    tag: int
    header: bool = False


@dataclass
class Receive:
    """A receive posted ahead of its use (see :meth:`PointToPoint.expect`).

    gloo sends by rendezvous: a sender's bytes move only once the receiver has posted its
    buffer, so a receive posted late costs the whole transfer on the receiver's critical
    path. Posting early lets the transfer overlap this rank's compute.
    """

    src: int
    tag: int
    what: str
    header: torch.Tensor | None = None
    header_work: dist.Work | None = None
    payload: torch.Tensor | None = None
    payload_work: dist.Work | None = None
    #: the :meth:`PointToPoint.batch` that carries the payload (waited on as a whole)
    batch: Pending | None = None


class PointToPoint:
    """Send and receive tensors with their shapes to and from other ranks of one group.

    Args:
        group: the process group; ranks below are ranks *within* it.
        timeout_s: how long any one wait may take.
        device: where received tensors are allocated: the group's communication device
            (:func:`syncline.comm.device.comm_device`; ``cuda`` for NCCL).
        ordered: one wire tag for every message (see the module docstring).

    Example:
        >>> p2p = PointToPoint(group, timeout_s=30)
        >>> pending = p2p.send(x, dst=1, tag=5, what="SEND_F mb 0 of step 0 to rank 1")
        >>> y = p2p.recv(src=0, tag=5, what="RECV_F mb 0 of step 0 from rank 0")  # on rank 1
        >>> pending.wait()
    """

    def __init__(
        self,
        group: Group = None,
        *,
        timeout_s: float = 300.0,
        device: torch.device | str = "cpu",
        ordered: bool = False,
    ) -> None:
        if timeout_s <= 0:
            raise CommError(f"timeout_s={timeout_s} must be > 0")
        self._group = group
        self._timeout_s = float(timeout_s)
        self._device = torch.device(device)
        self.ordered = ordered

    @property
    def rank(self) -> int:
        return group_rank(self._group)

    @property
    def timeout_s(self) -> float:
        return self._timeout_s

    @property
    def group(self) -> Group:
        return self._group

    @property
    def device(self) -> torch.device:
        """Where received tensors are allocated."""
        return self._device

    def _wire(self, tag: int, header: bool) -> int:
        """The tag on the wire of message ``tag``'s header or payload."""
        return 0 if self.ordered else 2 * tag + (0 if header else 1)

    def pending(
        self,
        works: Sequence[dist.Work | None],
        what: str,
        keep: Callable[[], None] | None = None,
        wire_bytes: int = 0,
    ) -> Pending:
        """``works`` as one :class:`Pending` (see the module docstring); ``keep`` is a
        follow-up that holds buffers alive until they are done."""
        started = [w for w in works if w is not None]
        return Pending(started, what, self._timeout_s, self.rank, keep, wire_bytes)

    def _peer(self, rank: int) -> int:
        return rank if self._group is None else dist.get_global_rank(self._group, rank)

    def _check_tag(self, tag: int) -> None:
        if not 0 <= tag <= MAX_TAG:
            raise CommError(f"rank {self.rank}: tag {tag} out of range [0, {MAX_TAG}]")

    def send(
        self, tensor: torch.Tensor, dst: int, *, tag: int, what: str, header: bool = True
    ) -> Pending:
        """Start sending ``tensor`` (header, then payload) to ``dst``; returns at once.

        Args:
            tensor: what to send.
            dst: the receiving rank within the group.
            tag: tells this message apart from the others in flight between the two ranks.
            what: the operation, for errors.
            header: send the shape header first; ``False`` only when the receiver knows
                the shape and dtype already (it then calls :meth:`recv` with them).

        The returned :class:`Pending` keeps the buffers alive until it is waited on or
        dropped; wait on it before reusing ``tensor``'s memory.

        Raises:
            CommError: the sends could not start.
        """
        self._check_tag(tag)
        payload = tensor.detach().contiguous()
        buffers = (encode_header(payload, tag, payload.device), payload) if header else (payload,)
        peer = self._peer(dst)
        try:
            works = [
                dist.isend(b, peer, group=self._group, tag=self._wire(tag, b is not payload))
                for b in buffers
            ]
        except RuntimeError as exc:
            raise CommError(f"rank {self.rank}: {what} could not start: {exc}") from exc
        return self.pending(works, what, _keeper(buffers), payload.nbytes)

    def batch(self, ops: Sequence[Op], what: str) -> Pending:
        """Issue ``ops`` as one ``batch_isend_irecv`` group (see the module docstring), in
        their order; returns at once. Wait on the result before reading a received buffer
        or reusing a sent one; its ``wire_bytes`` counts the payloads sent.

        Raises:
            CommError: the group could not start (naming ``what``).
        """
        if not ops:
            return self.pending([], what)
        for op in ops:
            self._check_tag(op.tag)
        group = [
            dist.P2POp(
                dist.isend if op.send else dist.irecv,
                op.tensor,
                self._peer(op.peer),
                self._group,
                self._wire(op.tag, op.header),
            )
            for op in ops
        ]
        try:
            works = dist.batch_isend_irecv(group)
        except RuntimeError as exc:
            raise CommError(f"rank {self.rank}: {what} could not start: {exc}") from exc
        sent = sum(op.tensor.nbytes for op in ops if op.send and not op.header)
        return self.pending(works, what, _keeper(tuple(op.tensor for op in ops)), sent)

    def expect(
        self,
        src: int,
        *,
        tag: int,
        what: str,
        like: tuple[tuple[int, ...], torch.dtype] | None = None,
    ) -> Receive:
        """Post a receive now, to be finished by :meth:`recv` when the tensor is needed.

        Args:
            src: the sending rank within the group.
            tag: as given to :meth:`send`.
            what: the operation, for errors.
            like: ``(shape, dtype)`` when known (the sender then sent no header), e.g. a
                gradient, which has the shape of the activation it belongs to: the payload
                buffer is posted at once. Otherwise the header is posted (a few bytes), and
                the payload as soon as :meth:`progress` or :meth:`recv` sees the header.
        """
        self._check_tag(tag)
        handle = Receive(src, tag, what)
        if like is not None:
            handle.payload = torch.empty(like[0], dtype=like[1], device=self._device)
            handle.payload_work = self._post(handle.payload, src, self._wire(tag, False), what)
        else:
            handle.header = empty_header(self._device)
            handle.header_work = self._post(handle.header, src, self._wire(tag, True), what)
        return handle

    def progress(self, handle: Receive) -> None:
        """Post the payload of ``handle`` if its header has arrived (never blocks)."""
        work = handle.header_work
        if handle.payload is None and (work is None or work.is_completed()):
            self._post_payload(handle)

    def recv(
        self,
        src: int,
        *,
        tag: int,
        what: str,
        like: tuple[tuple[int, ...], torch.dtype] | None = None,
        expected: Receive | None = None,
    ) -> torch.Tensor:
        """Receive the tensor that ``src`` sent with ``tag``; blocks, at most twice the timeout.

        Args:
            src, tag, what, like: as for :meth:`expect`.
            expected: the receive posted earlier by :meth:`expect` for this message.

        Raises:
            CommTimeout: a wait ran past ``timeout_s`` (``src`` is slow, stuck or dead).
            CommError: the peer closed its connection, or sent something else.
        """
        if expected is None:
            expected = self.expect(src, tag=tag, what=what, like=like)
        elif (expected.src, expected.tag) != (src, tag):
            raise CommError(
                f"rank {self.rank}: {what}: the receive posted is for rank {expected.src} tag "
                f"{expected.tag}"
            )
        if expected.batch is not None:  # issued in a batch: waiting waits for all of it
            expected.batch.wait()
            assert expected.payload is not None
            return expected.payload
        if expected.payload is None:
            self._wait(expected.header_work, what)
            self._post_payload(expected)
        self._wait(expected.payload_work, what)
        assert expected.payload is not None
        return expected.payload

    def read_header(self, handle: Receive) -> tuple[torch.dtype, tuple[int, ...]]:
        """What the header received into ``handle.header`` announces (a host sync: the
        header is read on the CPU).

        Raises:
            CommError: not a header, or one for another tag.
        """
        assert handle.header is not None
        try:
            return decode_header(handle.header.cpu(), handle.tag)
        except CommError as exc:
            raise CommError(f"rank {self.rank}: {handle.what}: {exc}") from None

    def _post_payload(self, handle: Receive) -> None:
        dtype, shape = self.read_header(handle)
        handle.payload = torch.empty(shape, dtype=dtype, device=self._device)
        handle.payload_work = self._post(
            handle.payload, handle.src, self._wire(handle.tag, False), handle.what
        )

    def _post(self, buffer: torch.Tensor, src: int, tag: int, what: str) -> dist.Work | None:
        try:
            return dist.irecv(buffer, self._peer(src), group=self._group, tag=tag)
        except RuntimeError as exc:
            raise CommError(f"rank {self.rank}: {what} could not start: {exc}") from exc

    def _wait(self, work: dist.Work | None, what: str) -> None:
        self.pending([work], what).wait()


def empty_header(device: torch.device) -> torch.Tensor:
    """A buffer to receive a header into."""
    return torch.empty(4 + MAX_DIMS, dtype=torch.int64, device=device)


def _keeper(buffers: tuple[torch.Tensor, ...]) -> Callable[[], None]:
    def keep_alive(buffers: tuple[torch.Tensor, ...] = buffers) -> None:
        del buffers  # referenced only so that the memory outlives the operations

    return keep_alive
