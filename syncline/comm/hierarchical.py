"""Hierarchical allreduce: reduce-scatter in the node, allreduce of shards across, allgather.

Jia et al. (Tencent, 2018) and Mikami et al. (Sony, 2018). With ``k``
ranks per node, ``N`` nodes and shard ``s = ceil(n/k)`` elements (the tensor is zero-padded to
``k*s``), rank ``r`` with local rank ``l`` runs::

    phase 1  intra-node reduce-scatter   node group     r owns the node's sum of shard l
    phase 2  inter-node allreduce        peer group     shard l summed over all nodes
    phase 3  intra-node allgather        node group     every rank has every summed shard

Bytes one rank sends (ring model, :func:`~syncline.comm.topology.hierarchical_allreduce_bytes`):
phase 1 ``(k-1)*s``, phase 2 ``2(N-1)/N * s`` (the only inter-node traffic: a ``1/k`` shard,
where a flat ring sends ``2(p-1)/p * n``), phase 3 ``(k-1)*s``.

On gloo (torch 2.13) ``reduce_scatter_single`` exists but is implemented inside the backend as
an allreduce of the whole tensor followed by taking the local chunk, so phase 1 costs
``2(k-1)*s`` intra-node bytes there instead of ``(k-1)*s``; and its work reports completion
only once waited on, which would keep :meth:`HierarchicalAllreduce.poll` from ever starting
phase 2. So on gloo phase 1 *is* that allreduce, issued directly (same bytes), and the
rank's shard is its slice of the result. The alternatives built from other
gloo primitives are no better: ``k`` rooted reduces (one per shard owner) also move about
``2(k-1)*s`` per rank and pay ``k`` times the latency; an intra-node allreduce followed by a
full-size inter-node allreduce would send ``k`` times more across nodes. Inter-node traffic,
the expensive part, is ``2(N-1)/N * s`` per rank in every case. NCCL runs a real reduce-scatter.

Ordering (how the phases become one :class:`~syncline.comm.collectives.Pending`): each phase
has a process group of its own (phase 1 and phase 3 both span the node, through two groups),
so that each group sees its collectives in launch order on every rank however the phases of
different jobs interleave. ``allreduce()`` starts phase 1 asynchronously and queues the job.
:meth:`HierarchicalAllreduce.poll`, which never blocks, starts phase 2 of the queued jobs
whose phase 1 is complete and phase 3 of those whose phase 2 is, each in launch order (a job
waits for the one before it); the data-parallel reducer calls it from every gradient hook,
and ``allreduce()`` calls it too, so phases 2 and 3 run while backward still computes. The
first ``wait()`` on a queued job finishes the whole queue, blocking, in the same order. All
collectives are issued from the caller's thread; no callback thread issues anything. A
rank's polls see completions at other moments than its peers', but that changes only *when*
it issues each group's next collective, never their order within the group, which is all a
process group needs on gloo.

NCCL forbids even that: its communicators share the GPU, and collectives issued on several
communicators in an order that differs between ranks can hang (NCCL's documentation asks
for one order on every rank). So with any backend but gloo, ``allreduce()`` issues all
three phases of a tensor at once, in bucket order, each after ``work.wait()`` on the one
before: on NCCL that makes the current CUDA stream wait for the previous phase (no host
block), and the next collective, queued behind that stream, starts when it is done. Every
rank then issues the same sequence on every communicator, and the overlap comes from the
streams instead of from polling; :meth:`HierarchicalAllreduce.poll` has nothing to do.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from syncline.comm.collectives import FlatAllreduce, Pending
from syncline.comm.groups import Group, backend_name, group_rank, group_ranks, is_initialized
from syncline.comm.topology import (
    Ranks,
    Topology,
    hierarchical_allreduce_bytes,
    ring_allreduce_bytes,
    subgroup_topology,
)
from syncline.errors import CommError, ConfigError
from syncline.fields import check_float


@dataclass
class _Job:
    """One hierarchical allreduce in flight."""

    tensor: torch.Tensor  # the caller's tensor; holds the result once finished
    full: torch.Tensor  # k*s elements: phase-1 input, phase-3 output (a view of tensor if it can)
    shard: torch.Tensor  # s elements: phase-1 output, phase-2 in place, phase-3 input
    what: str
    in_place: bool  # full is a view of tensor: nothing to copy back
    works: list[dist.Work] = field(default_factory=list)  # the running phase's
    phase: int = 1  # the phase running (or last run, once done)
    done: bool = False
    error: CommError | None = None


class HierarchicalAllreduce:
    """A :class:`~syncline.comm.collectives.Collective` that exploits fast intra-node links.

    The constructor only validates; :meth:`build` creates the process groups (every rank must
    call it, at the same point of the program). Results equal a flat allreduce's up to the
    order of floating-point additions (exactly, for integer-valued tensors).

    Args:
        topology: how the default group's ranks sit on nodes.
        timeout_s: how long each phase of a collective may take.

    Raises:
        ConfigError: on a bad timeout, or (in :meth:`build`) a topology that does not match
            the running group.

    Example:
        >>> topo = Topology.from_env_values(world_size, local_world_size)  # the CLI's job
        >>> model = DataParallel(net, allreduce=HierarchicalAllreduce(topo).build())
    """

    def __init__(
        self,
        topology: Topology,
        *,
        timeout_s: float = 300.0,
        group: Group = None,
        partition: Sequence[Ranks] | None = None,
        node_size: int | None = None,
    ) -> None:
        if not isinstance(topology, Topology):
            raise ConfigError(f"topology={topology!r} must be a Topology")
        check_float("timeout_s", timeout_s, above=0, finite=False)
        self._topology = topology
        self._timeout_s = float(timeout_s)
        # a subgroup (a pipeline stage's replicas): one block of ``partition``, the groups
        # that split the world, every one laid out over nodes of ``node_size`` ranks
        self._group = group
        self._partition = None if partition is None else [tuple(p) for p in partition]
        self._node_size = node_size
        if (partition is None) != (node_size is None):
            raise ConfigError("HierarchicalAllreduce: partition and node_size go together")
        self._flat: FlatAllreduce | None = None
        self._intra: Group = None
        self._inter: Group = None
        self._gather: Group = None  # phase 3's own intra-node group (see the docstring)
        self._scatter_as_allreduce = False
        self._at_once = False  # NCCL: every phase issued at launch (see the module docstring)
        self._queue: list[_Job] = []
        #: jobs whose phase 2 (phase 3) was started by :meth:`poll`, before any wait
        self.early_starts = {2: 0, 3: 0}
        #: inter-node bytes this rank sends in the last allreduce started (ring model)
        self.last_inter_node_bytes = 0
        #: intra-node bytes this rank sends in the last allreduce started (ring model)
        self.last_intra_node_bytes = 0

    # -- protocol -----------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return group_rank(self._group)

    @property
    def world_size(self) -> int:
        return self._topology.world_size

    @property
    def timeout_s(self) -> float:
        return self._timeout_s

    @property
    def topology(self) -> Topology:
        return self._topology

    @property
    def is_flat(self) -> bool:
        """One node, or one rank per node: a single flat allreduce over the world group."""
        return self._topology.num_nodes == 1 or self._topology.ranks_per_node == 1

    # -- setup --------------------------------------------------------------------------
    def build(self) -> HierarchicalAllreduce:
        """Create the intra-node groups, then the inter-node groups; returns ``self``.

        ``new_group`` must be entered by every rank for every group, in the same order, so
        each rank creates all of them and keeps the two it belongs to. Calling it again is a
        no-op.
        """
        if self._flat is not None:
            return self
        topo = self._topology
        if not is_initialized():
            raise CommError("HierarchicalAllreduce.build(): torch.distributed is not initialized")
        world = len(group_ranks(self._group))
        if world != topo.world_size:
            raise ConfigError(
                f"HierarchicalAllreduce: {topo} does not match the running group of "
                f"world_size={world}"
            )
        rank = dist.get_rank()
        blocks = self._partition or [tuple(range(world))]
        layouts = [(b, self._layout(b)) for b in blocks]
        # every rank creates every block's groups, in one order (new_group is collective)
        self._intra = self._make_phase("intra", layouts, rank)
        self._inter = self._make_phase("inter", layouts, rank)
        self._gather = self._make_phase("gather", layouts, rank)
        if not self.is_flat:
            self._scatter_as_allreduce = backend_name(self._intra) == "gloo"
            self._at_once = not self._scatter_as_allreduce
        self._flat = FlatAllreduce(self._group, timeout_s=self._timeout_s)
        return self

    def _layout(self, block: Ranks) -> Topology:
        """A block's topology, numbered by its group ranks."""
        if self._partition is None or self._node_size is None:
            return self._topology
        return subgroup_topology(block, self._node_size)

    def _make_phase(self, phase: str, layouts: list[tuple[Ranks, Topology]], rank: int) -> Group:
        mine: Group = None
        for block, topo in layouts:
            if topo.num_nodes == 1 or topo.ranks_per_node == 1:
                continue  # flat: no groups of its own
            sets = topo.inter_groups() if phase == "inter" else topo.intra_groups()
            got = self._new_groups(tuple(tuple(block[i] for i in g) for g in sets), rank)
            if rank in block:
                mine = got
        return mine

    def _new_groups(self, groups: tuple[tuple[int, ...], ...], rank: int) -> Group:
        timeout = datetime.timedelta(seconds=self._timeout_s)
        mine: Group = None
        for ranks in groups:
            try:
                group = dist.new_group(list(ranks), timeout=timeout)
            except RuntimeError as exc:
                raise CommError(f"rank {rank}: creating group {ranks} failed: {exc}") from exc
            if rank in ranks:
                mine = group
        return mine

    def _require_built(self) -> FlatAllreduce:
        if self._flat is None:
            raise CommError(
                "HierarchicalAllreduce: call build() on every rank before the first collective"
            )
        return self._flat

    # -- collectives --------------------------------------------------------------------
    def allreduce(self, tensor: torch.Tensor, what: str) -> Pending:
        """Sum ``tensor`` over all ranks, in place; the result is there after ``wait()``."""
        flat = self._require_built()
        nbytes = tensor.numel() * tensor.element_size()
        self.poll()
        if self.is_flat or tensor.numel() == 0:
            return self._flat_allreduce(flat, tensor, what, nbytes)
        k = self._topology.ranks_per_node
        s = math.ceil(tensor.numel() / k)
        in_place = s * k == tensor.numel() and tensor.is_contiguous()
        if in_place:
            full = tensor.view(-1)  # phase 3 writes the result straight into the tensor
        else:
            full = tensor.new_zeros(s * k)
            full[: tensor.numel()].copy_(tensor.reshape(-1))
        if self._scatter_as_allreduce:  # gloo: see the module docstring
            assert self._intra is not None  # built, not flat
            local = dist.get_group_rank(self._intra, dist.get_rank())
            job = _Job(tensor, full, full[local * s : (local + 1) * s], what, in_place)
            self._start(job, lambda: dist.all_reduce(full, group=self._intra, async_op=True))
        else:
            job = _Job(tensor, full, tensor.new_empty(s), what, in_place)
            self._start(
                job,
                lambda: dist.reduce_scatter_single(
                    job.shard, full, group=self._intra, async_op=True
                ),
            )
        if self._at_once:
            self._issue_all(job)
        else:
            self._queue.append(job)

        sent = hierarchical_allreduce_bytes(
            s * k * tensor.element_size(),
            self._topology,
            reduce_scatter_as_allreduce=self._scatter_as_allreduce,
        )
        self.last_intra_node_bytes = round(sent.intra)
        self.last_inter_node_bytes = round(sent.inter)
        return Pending(
            works=[],
            what=what,
            timeout_s=self._timeout_s,
            rank=group_rank(),
            then=lambda: self._finish(job),
            wire_bytes=nbytes,  # payload, as every Collective reports; the split is above
        )

    def allgather(self, tensor: torch.Tensor, what: str) -> tuple[Pending, list[torch.Tensor]]:
        """Gather every rank's ``tensor`` over the world group (nothing to gain per node)."""
        return self._require_built().allgather(tensor, what)

    def _flat_allreduce(
        self, flat: FlatAllreduce, tensor: torch.Tensor, what: str, nbytes: int
    ) -> Pending:
        pending = flat.allreduce(tensor, what)
        sent = round(ring_allreduce_bytes(nbytes, self.world_size))
        across = self._topology.num_nodes > 1
        self.last_inter_node_bytes = sent if across else 0
        self.last_intra_node_bytes = 0 if across else sent
        return pending

    # -- phases -------------------------------------------------------------------------
    def _start(self, job: _Job, launch: Callable[[], dist.Work | None]) -> None:
        try:
            work = launch()
        except RuntimeError as exc:
            raise CommError(f"rank {group_rank()}: {job.what} could not start: {exc}") from exc
        if work is None:  # only when this rank is not in the group: a build() bug
            raise CommError(f"rank {group_rank()}: {job.what} got no work handle")
        job.works = [work]

    def _launch_inter(self, job: _Job) -> Callable[[], dist.Work | None]:
        return lambda: dist.all_reduce(job.shard, group=self._inter, async_op=True)

    def _launch_gather(self, job: _Job) -> Callable[[], dist.Work | None]:
        # on gloo the shard is a slice of ``full``, the allgather's output: send a copy
        shard = job.shard.clone() if self._scatter_as_allreduce else job.shard
        return lambda: dist.all_gather_single(job.full, shard, group=self._gather, async_op=True)

    def _issue_all(self, job: _Job) -> None:
        """NCCL: phases 2 and 3 now, each queued behind the one before on the stream (the
        wait of :meth:`_wait` is a stream wait there, see ``Pending.wait``)."""
        for launch in (self._launch_inter, self._launch_gather):
            self._wait(job)
            self._start(job, launch(job))
            job.phase += 1

    def _wait(self, job: _Job) -> None:
        phase = _PHASES[job.phase]
        Pending(job.works, f"{job.what} ({phase})", self._timeout_s, group_rank()).wait()

    def _advance(self, job: _Job) -> None:
        """Phase ``job.phase`` is complete: start the next one, or finish the job."""
        self._wait(job)  # returns at once; raises if the phase failed
        if job.phase == 1:
            self._start(job, self._launch_inter(job))
        elif job.phase == 2:
            self._start(job, self._launch_gather(job))
        else:
            self._copy_back(job)
            return
        job.phase += 1

    def poll(self) -> None:
        """Start every queued job's next phase whose current phase is complete, in launch
        order per phase, without blocking (cheap when nothing is queued)."""
        if not self._queue:
            return
        try:
            for phase in (2, 1):  # phase-2 jobs first, so a job moves one phase per poll
                for job in self._queue:
                    if job.phase > phase:
                        continue
                    if job.phase < phase or not job.works[0].is_completed():
                        break  # later jobs of this phase wait for this one
                    self._advance(job)
                    self.early_starts[phase + 1] += 1
        except CommError as exc:
            self._fail(exc)
            raise

    def _finish(self, job: _Job) -> None:
        if self._at_once and not job.done:
            self._wait(job)
            self._copy_back(job)
            return
        if not job.done and job.error is None:
            self._drain()
        if job.error is not None:
            raise job.error

    @staticmethod
    def _copy_back(job: _Job) -> None:
        if not job.in_place:
            with torch.no_grad():
                n = job.tensor.numel()
                job.tensor.copy_(job.full[:n].view(job.tensor.shape))
        job.done = True

    def _drain(self) -> None:
        """Finish every queued job, blocking: each phase in launch order, jobs in lock step."""
        try:
            for phase in (1, 2, 3):
                for job in self._queue:
                    if job.phase == phase:
                        self._advance(job)
        except CommError as exc:
            self._fail(exc)
            raise
        self._queue = []

    def _fail(self, exc: CommError) -> None:
        for job in self._queue:
            if not job.done:
                job.error = exc
        self._queue = []


_PHASES = {1: "intra-node reduce-scatter", 2: "inter-node allreduce", 3: "intra-node allgather"}

__all__ = ["HierarchicalAllreduce"]


def build_hierarchical(
    group: Group, timeout_s: float, ranks_per_node: int | None
) -> HierarchicalAllreduce:
    """The ``hierarchical`` entry of :data:`syncline.comm.registry.ALLREDUCE`: over the
    world, or over ``group`` when the groups the ranks pass split the world (a pipeline
    stage's replicas: every rank calls this at the same point with its own group; the
    groups are gathered so that every rank creates every group's phase groups).

    Raises:
        ConfigError: no node size, groups that overlap, or a group spread unevenly on the
            nodes (naming it).
    """
    if ranks_per_node is None:
        raise ConfigError(
            "allreduce='hierarchical' needs ranks_per_node (torchrun's LOCAL_WORLD_SIZE)"
        )
    if group is None:
        topology = Topology(dist.get_world_size(), ranks_per_node)
        return HierarchicalAllreduce(topology, timeout_s=timeout_s).build()
    members = group_ranks(group)
    every: list[Ranks] = [() for _ in range(dist.get_world_size())]
    dist.all_gather_object(every, tuple(members))
    blocks = sorted(set(every))
    if sorted(r for b in blocks for r in b) != list(range(dist.get_world_size())):
        raise ConfigError(
            f"allreduce='hierarchical' over subgroups: the groups {blocks} do not split the "
            "world into disjoint groups; valid: one group per rank, each rank in one"
        )
    for block in blocks:
        subgroup_topology(block, ranks_per_node)  # every rank raises alike, before any group
    return HierarchicalAllreduce(
        subgroup_topology(members, ranks_per_node), timeout_s=timeout_s, group=group,
        partition=blocks, node_size=ranks_per_node,
    ).build()  # fmt: skip
