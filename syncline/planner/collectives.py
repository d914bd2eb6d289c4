"""PURE: the price of a collective, by algorithm, and of a bucket, by compressor.

Alpha-beta model (REFERENCE section 1; Patarasuk and Yuan 2009 for the ring): a ring
allreduce of ``n`` bytes over ``p`` ranks sends ``2(p-1)/p * n`` bytes per rank in
``2(p-1)`` messages and reduces ``(p-1)/p * n`` bytes on each rank; an allgather of ``n``
bytes from each rank receives ``(p-1) * n``. The hierarchical allreduce (Jia et al. 2018) is
an intra-node reduce-scatter, an inter-node allreduce of each ``1/k`` shard, and an intra-node
allgather. What each compressor puts on the wire per bucket is read from its own module's
docstring (``syncline.dp.compressors``); their compute is measured per byte.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from syncline.comm.topology import ring_allreduce_time
from syncline.dp.registry import COMPRESSORS, parse
from syncline.errors import ConfigError
from syncline.planner.hardware import Cluster, Link
from syncline.registry import resolve

__all__ = ["Phase", "allgather_s", "allreduce_s", "bucket_phases", "ring_allreduce_s"]


@dataclass(frozen=True)
class Phase:
    """One collective of a bucket's exchange: ``"allreduce"`` or ``"allgather"`` of
    ``nbytes`` per rank."""

    kind: str
    nbytes: float


def ring_allreduce_s(nbytes: float, p: int, link: Link, reduce_s_per_byte: float = 0.0) -> float:
    """Seconds of a ring allreduce of ``nbytes`` over ``p`` ranks on ``link``: the wire's
    (:func:`syncline.comm.topology.ring_allreduce_time`) plus summing ``(p-1)/p * n`` bytes."""
    if p <= 1 or nbytes <= 0:
        return 0.0
    wire = ring_allreduce_time(nbytes, p, link.latency_s, link.bandwidth)
    return wire + (p - 1) / p * nbytes * reduce_s_per_byte


def allgather_s(nbytes: float, p: int, link: Link) -> float:
    """Seconds of an allgather of ``nbytes`` from each of ``p`` ranks (ring)."""
    if p <= 1:
        return 0.0
    return (p - 1) * (link.latency_s + nbytes / link.bandwidth)


def allreduce_s(
    nbytes: float,
    ranks: Sequence[int],
    cluster: Cluster,
    algorithm: str = "flat",
    reduce_s_per_byte: float = 0.0,
) -> float:
    """Seconds of an allreduce of ``nbytes`` among global ``ranks`` (consecutive per node).

    ``algorithm`` is ``"flat"`` (one ring over the slowest link) or ``"hierarchical"``.

    Raises:
        ConfigError: an unknown algorithm.
    """
    p = len(ranks)
    if algorithm == "flat" or p <= 1:
        if algorithm not in ("flat", "hierarchical"):
            raise ConfigError(f"allreduce={algorithm!r}; valid: flat, hierarchical")
        return ring_allreduce_s(nbytes, p, cluster.link_between(list(ranks)), reduce_s_per_byte)
    if algorithm != "hierarchical":
        raise ConfigError(f"allreduce={algorithm!r}; valid: flat, hierarchical")
    k = min(cluster.ranks_per_node, p)
    nodes = -(-p // k)
    if nodes == 1:
        return ring_allreduce_s(nbytes, p, cluster.intra, reduce_s_per_byte)
    # the intra-node phases are a ring allreduce's two halves (comm.topology's model)
    intra = ring_allreduce_s(nbytes, k, cluster.intra, reduce_s_per_byte)
    # then k rings across nodes at once, one per rank of a node, over the node's ports
    inter = cluster.inter_shared(k)
    return intra + ring_allreduce_s(nbytes / k, nodes, inter, reduce_s_per_byte)


def bucket_phases(
    spec: str, numel: int, matrices: Sequence[tuple[int, int]] = (), value_bytes: int = 4
) -> list[Phase]:
    """The collectives one bucket of ``numel`` gradient elements costs under ``spec``, in
    the steady state (after any dense warm-up): the compressor's registered traffic model
    (:mod:`syncline.dp.traffic`), so a plug-in's that gives one is priced like a built-in.

    ``matrices`` are the bucket's weight shapes (PowerSGD compresses those; the rest of the
    bucket goes dense), near-square when not given.

    Raises:
        ConfigError: a spec the planner cannot price (a compressor registered without a
            traffic model), naming it.
    """
    entry, kwargs = parse(spec)
    if entry.traffic is None:
        priced = [c.name for c in COMPRESSORS if c.traffic is not None]
        raise ConfigError(
            f"compression={spec!r}: the planner has no traffic model for {entry.name!r} "
            f"(its CompressorSpec gives no traffic=); valid: {', '.join(priced)}"
        )
    phases = resolve(entry.traffic)(numel, list(matrices), value_bytes, **kwargs)
    return [Phase(kind, nbytes) for kind, nbytes in phases]


def phases_s(
    phases: Sequence[Phase],
    ranks: Sequence[int],
    cluster: Cluster,
    algorithm: str = "flat",
    reduce_s_per_byte: float = 0.0,
) -> float:
    """Seconds of a bucket's collectives, one after another."""
    total = 0.0
    for phase in phases:
        if phase.kind == "allgather":
            total += allgather_s(phase.nbytes, len(ranks), cluster.link_between(list(ranks)))
        else:
            total += allreduce_s(phase.nbytes, ranks, cluster, algorithm, reduce_s_per_byte)
    return total
