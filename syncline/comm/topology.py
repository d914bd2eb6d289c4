"""Which ranks share a node, how pipelines and their replicas tile the ranks, and what an
allreduce costs over two link speeds (pure, no torch).

The layout is torchrun's: ranks are numbered node by node, so node ``i`` holds the consecutive
ranks ``i*k .. i*k+k-1`` (``k`` ranks per node), and a rank's local rank is ``rank % k``.
For ``Topology(8, 4)``::

    node 0: ranks 0 1 2 3      intra-node groups: (0, 1, 2, 3) (4, 5, 6, 7)
    node 1: ranks 4 5 6 7      inter-node groups: (0, 4) (1, 5) (2, 6) (3, 7)

A hybrid pipeline x data-parallel job (PipeDream-2BW's depth ``d`` by width ``w``) puts the
replicas of one stage on consecutive ranks, ``rank = stage * w + replica``, so that each
stage's gradient allreduce runs inside a node (the fast links, where PipeDream-2BW places
replicas; Narayanan et al. 2021) and only the pipeline's point-to-point messages cross
nodes. For ``PipelineLayout(8, 4)``::

    stage 0: ranks 0 1   data-parallel groups: (0, 1) (2, 3) (4, 5) (6, 7)
    stage 1: ranks 2 3   pipeline groups:      (0, 2, 4, 6) (1, 3, 5, 7)
    stage 2: ranks 4 5
    stage 3: ranks 6 7

The cost functions use the alpha-beta model (Thakur et al. 2005; GradientFlow, Sun et al.
2019; hierarchical allreduce: Jia et al. 2018, Mikami et al. 2018). Sizes are bytes, times
seconds, bandwidths bytes per second.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from syncline.errors import ConfigError
from syncline.fields import check_float, check_int

Ranks = tuple[int, ...]


@dataclass(frozen=True)
class Topology:
    """``world_size`` ranks laid out as ``num_nodes`` nodes of ``ranks_per_node`` each.

    Validated on creation; pure data (process groups are built from it elsewhere, see
    :class:`syncline.comm.hierarchical.HierarchicalAllreduce`).

    Args:
        world_size: number of ranks in the job, >= 1.
        ranks_per_node: ranks on each node (torchrun's ``LOCAL_WORLD_SIZE``), >= 1, and a
            divisor of ``world_size`` (every node runs the same number of ranks).

    Raises:
        ConfigError: naming the bad value(s).

    Example:
        >>> topo = Topology(8, 4)
        >>> topo.num_nodes, topo.node_of(5), topo.local_rank(5)
        (2, 1, 1)
        >>> topo.node_ranks(1), topo.peer_ranks(1)
        ((4, 5, 6, 7), (1, 5))
    """

    world_size: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        for name in ("world_size", "ranks_per_node"):
            check_int(f"Topology: {name}", getattr(self, name))
        if self.world_size % self.ranks_per_node:
            raise ConfigError(
                f"Topology: world_size={self.world_size} is not a multiple of "
                f"ranks_per_node={self.ranks_per_node}; every node must run the same "
                "number of ranks"
            )

    @classmethod
    def from_env_values(cls, world_size: int | str, local_world_size: int | str) -> Topology:
        """Build from torchrun's ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE`` values.

        The caller (the CLI) reads the environment; this only parses and validates, so a
        missing or garbled variable is reported by its name.

        Example:
            >>> Topology.from_env_values("8", "4")
            Topology(world_size=8, ranks_per_node=4)
        """
        return cls(
            _parse_int("WORLD_SIZE", world_size),
            _parse_int("LOCAL_WORLD_SIZE", local_world_size),
        )

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def node_of(self, rank: int) -> int:
        """The node that runs ``rank``."""
        self._check("rank", rank, self.world_size)
        return rank // self.ranks_per_node

    def local_rank(self, rank: int) -> int:
        """``rank``'s index within its node (torchrun's ``LOCAL_RANK``)."""
        self._check("rank", rank, self.world_size)
        return rank % self.ranks_per_node

    def node_ranks(self, node: int) -> Ranks:
        """The intra-node group of ``node``: its consecutive ranks."""
        self._check("node", node, self.num_nodes)
        first = node * self.ranks_per_node
        return tuple(range(first, first + self.ranks_per_node))

    def peer_ranks(self, local_rank: int) -> Ranks:
        """The inter-node group of ``local_rank``: the rank with that local rank on each node."""
        self._check("local_rank", local_rank, self.ranks_per_node)
        return tuple(range(local_rank, self.world_size, self.ranks_per_node))

    def intra_groups(self) -> tuple[Ranks, ...]:
        """Every intra-node group, node 0 first."""
        return tuple(self.node_ranks(n) for n in range(self.num_nodes))

    def inter_groups(self) -> tuple[Ranks, ...]:
        """Every inter-node group, local rank 0 first."""
        return tuple(self.peer_ranks(r) for r in range(self.ranks_per_node))

    def _check(self, name: str, value: int, bound: int) -> None:
        if not 0 <= value < bound:
            raise ConfigError(f"{name}={value} out of range [0, {bound}) for {self}")


@dataclass(frozen=True)
class PipelineLayout:
    """``world_size`` ranks as ``width`` pipelines of ``num_stages`` ranks each.

    Rank ``stage * width + replica`` runs pipeline position ``stage`` of replica ``replica``
    (see the module docstring for why replicas are contiguous). Pure data, validated on
    creation; :func:`syncline.comm.groups.build_pipeline_groups` creates the groups.

    Args:
        world_size: ranks in the job, >= 1.
        num_stages: pipeline depth in ranks (interleaved: ranks per pipeline, not virtual
            stages), >= 1 and a divisor of ``world_size``.

    Raises:
        ConfigError: naming the bad value(s).

    Example:
        >>> layout = PipelineLayout(6, 3)
        >>> layout.width, layout.stage_of(4), layout.replica_of(4)
        (2, 2, 0)
        >>> layout.pipeline_ranks(1), layout.data_parallel_ranks(2)
        ((1, 3, 5), (4, 5))
    """

    world_size: int
    num_stages: int

    def __post_init__(self) -> None:
        for name in ("world_size", "num_stages"):
            check_int(f"PipelineLayout: {name}", getattr(self, name))
        if self.world_size % self.num_stages:
            raise ConfigError(
                f"world_size={self.world_size} is not divisible by num_stages="
                f"{self.num_stages}; valid: a world of num_stages x replicas ranks"
            )

    @property
    def width(self) -> int:
        """Number of data-parallel replicas of each stage (pipelines)."""
        return self.world_size // self.num_stages

    def stage_of(self, rank: int) -> int:
        """The pipeline position (rank within its pipeline group) of global ``rank``."""
        self._check("rank", rank, self.world_size)
        return rank // self.width

    def replica_of(self, rank: int) -> int:
        """The replica (pipeline) of global ``rank``: which data shard it trains on."""
        self._check("rank", rank, self.world_size)
        return rank % self.width

    def pipeline_ranks(self, replica: int) -> Ranks:
        """The ranks of pipeline ``replica``, stage 0 first."""
        self._check("replica", replica, self.width)
        return tuple(range(replica, self.world_size, self.width))

    def data_parallel_ranks(self, stage: int) -> Ranks:
        """The (consecutive) ranks holding replicas of pipeline position ``stage``."""
        self._check("stage", stage, self.num_stages)
        return tuple(range(stage * self.width, (stage + 1) * self.width))

    def _check(self, name: str, value: int, bound: int) -> None:
        if not 0 <= value < bound:
            raise ConfigError(f"{name}={value} out of range [0, {bound}) for {self}")


def pipeline_grid(world_size: int, num_stages: int) -> tuple[tuple[Ranks, ...], tuple[Ranks, ...]]:
    """Every pipeline group and every data-parallel group of a ``num_stages``-deep layout.

    Returns:
        ``(pipeline_groups, data_parallel_groups)``: replica 0's pipeline first, stage 0's
        replicas first; each group's ranks in increasing order.

    Raises:
        ConfigError: ``world_size`` is not divisible by ``num_stages`` (naming both).

    Example:
        >>> pipeline_grid(4, 2)
        (((0, 2), (1, 3)), ((0, 1), (2, 3)))
    """
    layout = PipelineLayout(world_size, num_stages)
    pipelines = tuple(layout.pipeline_ranks(i) for i in range(layout.width))
    replicas = tuple(layout.data_parallel_ranks(s) for s in range(num_stages))
    return pipelines, replicas


def _parse_int(name: str, value: int | str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    try:
        return int(str(value).strip())
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not an integer") from None


# -- alpha-beta cost model -----------------------------------------------------------------


def _check_cost_args(nbytes: float, p: int) -> None:
    check_float("nbytes", nbytes, at_least=0, finite=False)
    check_int("p", p)


def ring_allreduce_time(nbytes: float, p: int, alpha: float, bandwidth: float) -> float:
    """Seconds for a ring allreduce of ``nbytes`` over ``p`` ranks.

    ``T(n) = 2(p-1)*alpha + 2(p-1)/p * n / bandwidth`` (Thakur et al. 2005, the
    alpha-beta model of GradientFlow, Sun et al. 2019): a reduce-scatter and an allgather of
    ``p-1`` steps each, every step moving ``n/p`` bytes per rank. ``p == 1`` costs nothing.

    Example:
        >>> ring_allreduce_time(1e9, 4, 1e-5, 1e10)  # 6 latencies + 1.5e9 B at 10 GB/s
        0.15006
    """
    _check_cost_args(nbytes, p)
    check_float("bandwidth", bandwidth, above=0, finite=False)
    if p == 1:
        return 0.0
    return 2 * (p - 1) * alpha + 2 * (p - 1) / p * nbytes / bandwidth


def hierarchical_allreduce_time(
    nbytes: float,
    topology: Topology,
    alpha_intra: float,
    bw_intra: float,
    alpha_inter: float,
    bw_inter: float,
) -> float:
    """Seconds for a hierarchical allreduce (Jia et al. 2018).

    With ``k`` ranks per node and ``N`` nodes, the three ring phases cost::

        intra reduce-scatter   (k-1)*alpha_intra + (k-1)/k * n / bw_intra
        inter allreduce        2(N-1)*alpha_inter + 2(N-1)/N * (n/k) / bw_inter
        intra allgather        (k-1)*alpha_intra + (k-1)/k * n / bw_intra

    i.e. ``ring_allreduce_time(n, k, intra) + ring_allreduce_time(n/k, N, inter)``: each of the
    ``k`` concurrent inter-node rings carries only a ``1/k`` shard, and only ``2(N-1)`` (not
    ``2(p-1)``) latencies are paid at inter-node speed. ``bw_inter`` is what one rank gets
    across nodes while its ``k-1`` node-mates use the network too.
    """
    k, nodes = topology.ranks_per_node, topology.num_nodes
    return ring_allreduce_time(nbytes, k, alpha_intra, bw_intra) + ring_allreduce_time(
        nbytes / k, nodes, alpha_inter, bw_inter
    )


def bus_bandwidth(nbytes: float, seconds: float, p: int) -> float:
    """Allreduce bus bandwidth as nccl-tests reports it: ``busbw = (n / T) * 2(p-1)/p``.

    Comparable across ``p``, and with the link speed, since a ring allreduce moves
    ``2(p-1)/p * n`` bytes through every rank's link (Thakur et al. 2005).

    Example:
        >>> bus_bandwidth(1e9, 0.15, 4)  # the ring above, without its latency
        10000000000.0
    """
    _check_cost_args(nbytes, p)
    check_float("seconds", seconds, above=0, finite=False)
    return nbytes / seconds * 2 * (p - 1) / p


class AllreduceBytes(NamedTuple):
    """Bytes one rank sends in an allreduce, split by link kind (ring model)."""

    intra: float
    inter: float


def ring_allreduce_bytes(nbytes: float, p: int) -> float:
    """Bytes each rank sends in a ring allreduce: ``2(p-1)/p * n``."""
    _check_cost_args(nbytes, p)
    return 2 * (p - 1) / p * nbytes


def hierarchical_allreduce_bytes(
    nbytes: float, topology: Topology, *, reduce_scatter_as_allreduce: bool = False
) -> AllreduceBytes:
    """Bytes each rank sends in a hierarchical allreduce of ``nbytes``, intra- vs inter-node.

    With shard ``s = n/k``: the intra-node reduce-scatter sends ``(k-1)*s``, the inter-node
    ring allreduce of the shard ``2(N-1)/N * s``, the intra-node allgather ``(k-1)*s``. Across
    nodes each rank sends ``2(N-1)/N * n/k`` instead of the flat ring's ``2(p-1)/p * n``:
    at least ``k`` times less.

    Args:
        reduce_scatter_as_allreduce: the reduce-scatter is run as an intra-node allreduce
            whose result is then sliced (what gloo does internally), costing ``2(k-1)*s``.
    """
    k, nodes = topology.ranks_per_node, topology.num_nodes
    shard = nbytes / k
    scatter = (2 if reduce_scatter_as_allreduce else 1) * (k - 1) * shard
    return AllreduceBytes(intra=scatter + (k - 1) * shard, inter=ring_allreduce_bytes(shard, nodes))


__all__ = [
    "AllreduceBytes",
    "PipelineLayout",
    "Topology",
    "bus_bandwidth",
    "hierarchical_allreduce_bytes",
    "hierarchical_allreduce_time",
    "pipeline_grid",
    "ring_allreduce_bytes",
    "ring_allreduce_time",
]


def subgroup_topology(members: Ranks, ranks_per_node: int) -> Topology:
    """The layout of a subgroup's ``members`` (global ranks, in group order) over nodes of
    ``ranks_per_node`` consecutive global ranks, numbered by group rank: what a hierarchical
    allreduce over that subgroup runs on (a pipeline stage's replicas that span nodes).

    Raises:
        ConfigError: the members are not in increasing order, or the nodes hold different
            numbers of them (no hierarchical layout; the flat ring is the valid choice).
    """
    if list(members) != sorted(set(members)) or not members:
        raise ConfigError(f"subgroup ranks {list(members)}: valid: increasing global ranks")
    per_node: dict[int, int] = {}
    for r in members:
        per_node[r // ranks_per_node] = per_node.get(r // ranks_per_node, 0) + 1
    counts = sorted(set(per_node.values()))
    if len(counts) > 1:
        raise ConfigError(
            f"subgroup ranks {list(members)} sit unevenly on nodes of {ranks_per_node} "
            f"(members per node: {per_node}); a hierarchical allreduce needs the same "
            "number on every node: valid: allreduce='flat' for this group"
        )
    return Topology(len(members), counts[0])
