"""Asynchronous collectives behind a small strategy protocol, with named timeouts.

The data-parallel engine asks a :class:`Collective` to reduce a tensor and gets a
:class:`Pending` back. Which algorithm runs (one flat ring, or hierarchical over nodes) is the
collective's business, so a new algorithm plugs in without touching the engine's hooks.
"""

from __future__ import annotations

import datetime
import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from syncline.comm import groups as _groups
from syncline.comm.device import comm_device
from syncline.comm.groups import Group, global_rank, group_rank, group_size
from syncline.errors import CommError, CommTimeout


@dataclass
class Pending:
    """An operation in flight; :meth:`wait` finishes it (and any follow-up) or fails loudly.

    Attributes:
        works: the torch ``Work`` handles to wait for, in order.
        what: human description for errors, e.g. ``"allreduce of bucket 3 at step 17"``.
        timeout_s: how long each wait may take under gloo (elsewhere the process group's own
            timeout applies, see :meth:`wait`); errors quote it.
        rank: the rank errors name: the global one (the one in logs and launcher messages),
            also for a subgroup, whose own numbering would point at another process.
        then: optional follow-up run once all works are done (e.g. decompression).
        wire_bytes: payload bytes this rank handed to the network for this operation (the
            compressed size for compressors), before the algorithm's own traffic factor
            (2(p-1)/p for a ring); the same measure for every Collective, so runs compare.
        deps: other operations ``then`` waits for (a :func:`chain`'s parts), so that
            :meth:`is_done` can answer without blocking.
    """

    works: list[dist.Work]
    what: str
    timeout_s: float
    rank: int
    then: Callable[[], None] | None = None
    wire_bytes: int = 0
    deps: list[Pending] = field(default_factory=list)
    _done: bool = field(default=False, repr=False)

    def is_done(self) -> bool:
        """Whether :meth:`wait` would return at once: every work (and dependency) finished,
        successfully or not (a failure is raised by :meth:`wait`). Never blocks.

        Which ranks see an operation done at a given moment differs, so this may decide only
        *when* a rank issues its next collective on a group, never *which* one (see
        :class:`syncline.dp.compressors._pending.PhaseOrder`).
        """
        if self._done:
            return True
        return all(w.is_completed() for w in self.works) and all(d.is_done() for d in self.deps)

    def wait(self) -> None:
        """Finish the operation, then run :attr:`then`.

        gloo: each work is waited on the host for at most :attr:`timeout_s`, and a timeout
        raises :class:`~syncline.errors.CommTimeout` naming the rank and :attr:`what`.
        Other backends (NCCL): ``Work.wait()`` without a timeout, which for CUDA tensors
        only makes the current stream wait for the collective's stream: the host goes on
        queueing work (``then`` included, ordered after the collective on the stream)
        instead of polling in a loop until the GPU is done. Such a wait cannot overrun: the
        process group's own timeout, set when it was created
        (:func:`~syncline.comm.groups.init_with_file_store`, ``new_group``), is enforced by
        NCCL's watchdog, which aborts the communicator and raises.
        """
        if self._done:
            return
        timeout = datetime.timedelta(seconds=self.timeout_s) if _groups.is_gloo() else None
        for work in self.works:
            try:
                ok = work.wait() if timeout is None else work.wait(timeout)
            except RuntimeError as exc:
                raise _groups.comm_error(self.rank, self.what, exc, self.timeout_s) from exc
            if ok is False:
                raise CommTimeout(
                    f"rank {self.rank}: {self.what} did not complete within {self.timeout_s:.0f}s"
                )
        self._done = True
        if self.then is not None:
            self.then()


#: The bucket DDP hands a communication hook (``ddp.register_comm_hook``), named here so that
#: the layers above can type a hook without importing torch.distributed (and must: DDP
#: refuses a hook whose ``bucket`` annotation is anything but this very class).
GradBucket = dist.GradBucket


def completed(what: str, then: Callable[[], None] | None = None) -> Pending:
    """A :class:`Pending` with nothing in flight (single process, or purely local work)."""
    return Pending(works=[], what=what, timeout_s=0.0, rank=0, then=then)


class Collective(Protocol):
    """What a compressor needs from the network: sum-allreduce and allgather, async."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def timeout_s(self) -> float: ...

    def allreduce(self, tensor: torch.Tensor, what: str) -> Pending:
        """Sum ``tensor`` over all ranks, in place."""
        ...

    def allgather(self, tensor: torch.Tensor, what: str) -> tuple[Pending, list[torch.Tensor]]:
        """Gather every rank's ``tensor`` (same shape on every rank) into a new list."""
        ...


class FlatAllreduce:
    """One collective over the whole group: gloo's or NCCL's own ring/tree algorithm.

    Attributes:
        lane: a second :class:`FlatAllreduce` over another process group of the same ranks,
            or None. Collectives are matched by issue order *per group*, so a compressor
            whose second collective depends on its first (CSC's payload on its scores) can
            issue the second ones on the lane, in their own fixed order, as soon as each
            first one is done, instead of at a point every rank reaches in step
            (:class:`~syncline.dp.compressors._pending.PhaseOrder`). Made by
            :func:`with_lane`.
    """

    def __init__(
        self, group: Group = None, *, timeout_s: float = 300.0, lane: FlatAllreduce | None = None
    ) -> None:
        self._group = group
        self._timeout_s = timeout_s
        self.lane = lane

    @property
    def rank(self) -> int:
        return group_rank(self._group)

    @property
    def world_size(self) -> int:
        return group_size(self._group)

    @property
    def timeout_s(self) -> float:
        return self._timeout_s

    def _pending(self, work: dist.Work | None, what: str, nbytes: int) -> Pending:
        works = [] if work is None else [work]
        return Pending(works, what, self._timeout_s, global_rank(), wire_bytes=nbytes)

    def allreduce(self, tensor: torch.Tensor, what: str) -> Pending:
        nbytes = tensor.numel() * tensor.element_size()
        if self.world_size == 1:
            return self._pending(None, what, 0)
        try:
            work = dist.all_reduce(tensor, group=self._group, async_op=True)
        except RuntimeError as exc:
            raise CommError(f"rank {global_rank()}: {what} could not start: {exc}") from exc
        return self._pending(work, what, nbytes)

    def allgather(self, tensor: torch.Tensor, what: str) -> tuple[Pending, list[torch.Tensor]]:
        if self.world_size == 1:
            return self._pending(None, what, 0), [tensor.clone()]
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        try:
            work = dist.all_gather(out, tensor.contiguous(), group=self._group, async_op=True)
        except RuntimeError as exc:
            raise CommError(f"rank {global_rank()}: {what} could not start: {exc}") from exc
        return self._pending(work, what, tensor.numel() * tensor.element_size()), out


def allreduce_sparse(
    tensor: torch.Tensor,
    *,
    group: Group = None,
    what: str,
    timeout_s: float = 300.0,
    by_allgather: bool | None = None,
) -> Pending:
    """Sum a sparse COO ``tensor`` over all ranks, in place (its indices and values change;
    the result is coalesced).

    Sparse gradients (``nn.Embedding(sparse=True)``) cannot join a dense bucket; as DDP, each
    is reduced on its own. gloo has a sparse ``all_reduce`` (it allgathers every rank's
    indices and values and sums them on the host). Stock NCCL has none ("NCCL does not
    support all_reduce with sparse tensors", which is where DDP stops), so on every backend
    but gloo the same algorithm runs here over dense allgathers on the communication device
    (:func:`_sparse_by_allgather`), and gives gloo's result bit for bit.

    Args:
        by_allgather: force the allgather algorithm (``True``, as tests do on gloo) or
            gloo's own (``False``); ``None``: by the group's backend.
    """
    if not tensor.is_sparse:
        raise ValueError(f"{what}: allreduce_sparse needs a sparse COO tensor, got {tensor.layout}")
    if group_size(group) == 1:
        return completed(what)
    if by_allgather is None:
        by_allgather = not _groups.is_gloo(group)
    if by_allgather:
        return _sparse_by_allgather(tensor, group, what, timeout_s)
    nbytes = tensor._indices().numel() * 8 + tensor._values().numel() * tensor.element_size()
    try:
        work = dist.all_reduce(tensor, group=group, async_op=True)
    except RuntimeError as exc:
        raise CommError(f"rank {global_rank()}: {what} could not start: {exc}") from exc
    return Pending([work], what, timeout_s, global_rank(), wire_bytes=nbytes)


def _sparse_by_allgather(
    tensor: torch.Tensor, group: Group, what: str, timeout_s: float
) -> Pending:
    """gloo's sparse allreduce over dense collectives (``ProcessGroupGloo``'s
    ``AsyncSparseAllreduceWork``): coalesce locally; allgather every rank's ``nnz``; allgather
    the indices and values padded to the largest ``nnz``; then concatenate the ranks' parts in
    rank order and coalesce, as gloo sums them, so the result is gloo's bit for bit.

    The sizes are read on the host (one sync): the only way to size the padded buffers, as
    in gloo. It happens at the end of backward, once per sparse parameter.
    """
    local = tensor.coalesce()
    size = group_size(group)
    dev = comm_device(_groups.backend_name(group), tensor.device)
    flat = FlatAllreduce(group, timeout_s=timeout_s)
    indices, values = local._indices().to(dev), local._values().to(dev)
    nnz = indices.shape[1]
    counts = torch.full((1,), nnz, dtype=torch.int64, device=dev)
    pending, gathered = flat.allgather(counts, f"{what} (sizes)")
    pending.wait()
    sizes = [int(n) for n in host_list(torch.cat(gathered), meta=[nnz] * size)]
    most = max(sizes)
    if most == 0:  # every rank's gradient is empty; so is the sum
        tensor.copy_(local)
        return completed(what)
    padded_i = indices.new_zeros((indices.shape[0], most))
    padded_i[:, :nnz] = indices
    padded_v = values.new_zeros((most, *values.shape[1:]))
    padded_v[:nnz] = values
    got_i, all_i = flat.allgather(padded_i, f"{what} (indices)")
    got_v, all_v = flat.allgather(padded_v, f"{what} (values)")

    def total() -> None:
        cat_i = torch.cat([t[:, :n] for t, n in zip(all_i, sizes, strict=True)], dim=1)
        cat_v = torch.cat([t[:n] for t, n in zip(all_v, sizes, strict=True)])
        # every part came from a coalesced tensor of this shape on its rank: no checks needed
        summed = torch.sparse_coo_tensor(
            cat_i, cat_v, tensor.shape, check_invariants=False
        ).coalesce()
        tensor.copy_(summed.to(tensor.device))

    return Pending(
        got_i.works + got_v.works,
        what,
        timeout_s,
        global_rank(),
        then=total,
        wire_bytes=8 + padded_i.numel() * 8 + padded_v.numel() * padded_v.element_size(),
    )


def host_list(tensor: torch.Tensor, *, meta: list[Any]) -> list[Any]:
    """``tensor.tolist()``: the values a collective delivered, read on the host (one sync;
    never in a steady-state step). A tensor on the ``meta`` device has no values: there
    (tests that run a model on ``meta`` with torch's ``fake`` backend, which delivers
    nothing) ``meta`` stands in, what this rank would read if every rank were like it,
    unless a test's instrumentation answers the read itself (and records it).
    """
    try:
        return list(tensor.tolist())
    except (RuntimeError, NotImplementedError):
        if tensor.device.type != "meta":
            raise
        return list(meta)


def broadcast_tensors_async(
    tensors: Sequence[torch.Tensor],
    *,
    src: int = 0,
    group: Group = None,
    what: str = "broadcast",
    timeout_s: float = 300.0,
) -> Pending:
    """Start broadcasting ``tensors`` from ``src`` (a rank *within* ``group``) as ONE message.

    Tensors of any mix of dtypes are packed as raw bytes into one buffer: a model has tens to
    hundreds of parameters and buffers (BatchNorm keeps float statistics and an int64
    counter), and each extra message costs a full latency. The snapshot is taken now; the
    receivers' tensors are overwritten when the returned :class:`Pending` is waited on.
    """
    return PackedBroadcast(tensors, src=src, group=group, timeout_s=timeout_s).start(what)


class PackedBroadcast:
    """Broadcast the same tensors from ``src`` as one message, again and again.

    For what is sent every step (BatchNorm's buffers): the packed layout, its buffer and a
    view of it per tensor are made once, on the first :meth:`start`, so each round packs and
    unpacks with one batched copy each (``torch._foreach_copy_``) instead of several
    Python-dispatched ops per tensor (that took ~0.5 ms of a 9 ms CNN step). The tensors must
    stay the same objects (updated in place, as BatchNorm does); DDP keeps its list of
    buffers from construction too. :func:`broadcast_tensors_async` is one round of it.
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        src: int = 0,
        group: Group = None,
        timeout_s: float = 300.0,
    ) -> None:
        self._tensors = [t.detach() for t in tensors]
        self._src = src
        self._group = group
        self._timeout_s = timeout_s
        self._flat: torch.Tensor | None = None
        self._slots: list[torch.Tensor] = []

    def _layout(self) -> torch.Tensor:
        offsets, total = [], 0
        for t in self._tensors:  # 16-byte aligned, so each slot can be viewed as its dtype
            offsets.append(total)
            total += -(-t.numel() * t.element_size() // 16) * 16
        flat = torch.empty(total, dtype=torch.uint8, device=self._tensors[0].device)
        self._slots = [
            flat[off : off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            for t, off in zip(self._tensors, offsets, strict=True)
        ]
        self._flat = flat
        return flat

    def start(self, what: str, src: int | None = None) -> Pending:
        """Snapshot the tensors now and send them; waiting on the result overwrites them on
        the other ranks. The previous round must have been waited on. ``src``: this round's
        sender, when not the one given at construction (under ``join()``, the sender is
        agreed each round)."""
        if group_size(self._group) == 1 or not self._tensors:
            return completed(what)
        src = self._src if src is None else src
        flat = self._flat if self._flat is not None else self._layout()
        is_src = group_rank(self._group) == src
        if is_src:
            torch._foreach_copy_(self._slots, self._tensors)
        global_src = src if self._group is None else dist.get_global_rank(self._group, src)
        try:
            work = dist.broadcast(flat, src=global_src, group=self._group, async_op=True)
        except RuntimeError as exc:
            raise CommError(f"rank {global_rank()}: {what} could not start: {exc}") from exc

        def unpack() -> None:
            torch._foreach_copy_(self._tensors, self._slots)

        return Pending(
            [work],
            what,
            self._timeout_s,
            global_rank(),
            then=None if is_src else unpack,
            wire_bytes=flat.numel(),
        )


def broadcast_tensors(
    tensors: Sequence[torch.Tensor], *, src: int = 0, group: Group = None, what: str = "broadcast"
) -> None:
    """Blocking :func:`broadcast_tensors_async`."""
    broadcast_tensors_async(tensors, src=src, group=group, what=what).wait()


def _payload_device(group: Group, device: torch.device | None) -> torch.device:
    """Where the serialised payloads travel: the communication device of ``group``'s backend
    for a rank computing on ``device`` (the CPU when not given: so under NCCL, the current
    CUDA device, since NCCL takes CUDA tensors only)."""
    return comm_device(_groups.backend_name(group), device or torch.device("cpu"))


def _padded_payloads(
    obj: Any, group: Group, what: str, timeout_s: float, device: torch.device | None
) -> tuple[torch.Tensor, list[int]]:
    """``obj`` serialised (``torch.save``) into a uint8 tensor padded to the longest payload
    of the group, on the communication device, and every rank's payload length (allgathered
    first, then read on the host)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    dev = _payload_device(group, device)
    length = torch.full((1,), len(data), dtype=torch.int64, device=dev)
    pending, lengths = FlatAllreduce(group, timeout_s=timeout_s).allgather(
        length, f"{what} (sizes)"
    )
    pending.wait()
    sizes = [int(n) for n in host_list(torch.cat(lengths), meta=[len(data)] * len(lengths))]
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=dev)
    padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return padded, sizes


def _loaded(payloads: Sequence[torch.Tensor], sizes: list[int], mine: Any) -> list[Any]:
    """The objects :func:`_padded_payloads` serialised, back from the gathered tensors.

    Tensors inside come back on the CPU (``map_location``): a peer's ``cuda:1`` may not
    exist in this process (one visible GPU per rank), and where it does it is not this
    rank's device. On ``meta`` (see :func:`host_list`) every rank's object is ``mine``.
    """
    if payloads and payloads[0].device.type == "meta":
        return [mine for _ in payloads]
    return [
        torch.load(
            io.BytesIO(t[:n].cpu().numpy().tobytes()), map_location="cpu", weights_only=False
        )
        for t, n in zip(payloads, sizes, strict=True)
    ]


def gather_objects(
    obj: Any,
    *,
    dst: int = 0,
    group: Group = None,
    what: str = "gather",
    timeout_s: float = 300.0,
    device: torch.device | None = None,
) -> list[Any] | None:
    """Gather one object from every rank of ``group`` to ``dst`` (a rank *within* ``group``).

    For end-of-run results (stage weights, traces, memory statistics), not for the hot path.
    Objects go through ``torch.save``, so tensors keep dtype and shape (and come back on the
    CPU); the sizes are allgathered first, then the padded payloads gathered in one message
    per rank, on the communication device of the group's backend for a rank computing on
    ``device`` (default: the CPU's, i.e. the current CUDA device under NCCL). Unlike
    ``dist.gather_object`` every wait has ``timeout_s`` and names ``what`` when it fails.

    Returns:
        On ``dst``: the objects in group-rank order. Elsewhere: ``None``.

    Raises:
        CommError, CommTimeout: a peer failed or did not take part in time.
    """
    rank, size = group_rank(group), group_size(group)
    if size == 1:
        return [obj]
    padded, sizes = _padded_payloads(obj, group, what, timeout_s, device)
    out = [torch.empty_like(padded) for _ in range(size)] if rank == dst else None
    global_dst = dst if group is None else dist.get_global_rank(group, dst)
    try:
        work = dist.gather(padded, gather_list=out, dst=global_dst, group=group, async_op=True)
    except RuntimeError as exc:
        raise CommError(f"rank {rank}: {what} could not start: {exc}") from exc
    Pending([] if work is None else [work], what, timeout_s, rank, wire_bytes=sizes[rank]).wait()
    return None if out is None else _loaded(out, sizes, obj)


def allgather_objects(
    obj: Any,
    *,
    group: Group = None,
    what: str = "allgather",
    timeout_s: float = 300.0,
    device: torch.device | None = None,
) -> list[Any]:
    """Every rank's ``obj`` (small, ``torch.save``-able), in group-rank order, on every rank.

    For construction-time checks that every rank must fail together (the data-parallel
    engine's parameter comparison), not for the hot path. As :func:`gather_objects`: sizes
    first, then the padded payloads (on the communication device for ``device``); each wait
    has ``timeout_s`` and names ``what``.

    Raises:
        CommError, CommTimeout: a peer failed or did not take part in time.
    """
    if group_size(group) == 1:
        return [obj]
    padded, sizes = _padded_payloads(obj, group, what, timeout_s, device)
    pending, out = FlatAllreduce(group, timeout_s=timeout_s).allgather(padded, what)
    pending.wait()
    return _loaded(out, sizes, obj)


def with_lane(flat: FlatAllreduce) -> FlatAllreduce:
    """``flat`` with a :attr:`~FlatAllreduce.lane`: a new process group of the same ranks,
    where that is safe; otherwise ``flat`` unchanged.

    A collective call: every rank of the job enters it. Made only for the default group
    (``dist.new_group`` must be entered by every rank of the job, which a wrapper over a
    subgroup cannot promise) on gloo.

    Not under NCCL, on purpose. A lane's collectives are issued when a first-phase
    collective is seen done (:meth:`Pending.is_done`), a moment that differs across ranks,
    so the order of the two communicators' launches differs across ranks too. NCCL asks
    for one launch order across communicators that share a GPU ("Using multiple NCCL
    communicators concurrently" in NCCL's documentation): each collective's kernel waits on
    the GPU for its peers, and two kernels queued in opposite orders on two ranks can each
    hold the resources the other needs, a hang no timeout names. Nor is a lane needed
    there: under NCCL :meth:`Pending.wait` is a stream wait that returns at once, so a
    compressor can issue its second phase right after the first in program order, on one
    communicator, and the GPU orders them; the host never blocks inside a gradient hook.

    Every call makes a new group, on purpose: a lane shared by two engines whose backward
    passes interleave (two DataParallel modules in one autograd graph) would carry both
    engines' second collectives in an order set by timing, which can differ across ranks.
    The price is one gloo group per engine that asks for a lane.
    """
    if not _lane_possible(flat):
        return flat
    laned = FlatAllreduce(flat._group, timeout_s=flat.timeout_s)
    open_lane(laned)
    return laned


def _lane_possible(flat: FlatAllreduce) -> bool:
    group = flat._group
    if flat.lane is not None or flat.world_size == 1:
        return False
    return group in (None, dist.GroupMember.WORLD) and _groups.is_gloo(group)


def open_lane(flat: FlatAllreduce) -> None:
    """Give ``flat`` its lane in place, where :func:`with_lane` would make one (else
    nothing): a collective call, made by :class:`~syncline.dp.DataParallel` at its first
    training forward, a point every rank reaches, rather than in its constructor (which
    then makes no process group of its own)."""
    if _lane_possible(flat):
        timeout = datetime.timedelta(seconds=flat.timeout_s)
        lane_group = dist.new_group(list(range(dist.get_world_size())), timeout=timeout)
        flat.lane = FlatAllreduce(lane_group, timeout_s=flat.timeout_s)


def build_flat(group: Group, timeout_s: float, ranks_per_node: int | None) -> FlatAllreduce:
    """The ``flat`` entry of :data:`syncline.comm.registry.ALLREDUCE` (node size unused)."""
    del ranks_per_node
    return FlatAllreduce(group, timeout_s=timeout_s)
