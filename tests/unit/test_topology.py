"""Topology is pure data: literal rank tables, bad input, and the alpha-beta cost closed forms."""

from __future__ import annotations

import pathlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from syncline.comm.topology import (
    Topology,
    bus_bandwidth,
    hierarchical_allreduce_bytes,
    hierarchical_allreduce_time,
    ring_allreduce_bytes,
    ring_allreduce_time,
)
from syncline.errors import ConfigError
from tests.zoo.fresh import run_python


def _table(topo: Topology) -> list[tuple[int, int, int]]:
    return [(r, topo.node_of(r), topo.local_rank(r)) for r in range(topo.world_size)]


def test_eight_ranks_on_two_nodes_of_four() -> None:
    topo = Topology(8, 4)
    assert topo.num_nodes == 2
    assert _table(topo) == [
        (0, 0, 0),
        (1, 0, 1),
        (2, 0, 2),
        (3, 0, 3),
        (4, 1, 0),
        (5, 1, 1),
        (6, 1, 2),
        (7, 1, 3),
    ]
    assert topo.node_ranks(0) == (0, 1, 2, 3)
    assert topo.node_ranks(1) == (4, 5, 6, 7)
    assert topo.peer_ranks(2) == (2, 6)
    assert topo.intra_groups() == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert topo.inter_groups() == ((0, 4), (1, 5), (2, 6), (3, 7))


def test_four_ranks_on_two_nodes_of_two() -> None:
    topo = Topology(4, 2)
    assert topo.num_nodes == 2
    assert _table(topo) == [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    assert topo.intra_groups() == ((0, 1), (2, 3))
    assert topo.inter_groups() == ((0, 2), (1, 3))


def test_six_ranks_one_per_node() -> None:
    topo = Topology(6, 1)
    assert topo.num_nodes == 6
    assert _table(topo) == [(r, r, 0) for r in range(6)]
    assert topo.intra_groups() == ((0,), (1,), (2,), (3,), (4,), (5,))
    assert topo.inter_groups() == ((0, 1, 2, 3, 4, 5),)


def test_from_env_values_parses_torchrun_strings() -> None:
    assert Topology.from_env_values("8", "4") == Topology(8, 4)
    assert Topology.from_env_values(4, 4) == Topology(4, 4)
    with pytest.raises(ConfigError, match="LOCAL_WORLD_SIZE='four'"):
        Topology.from_env_values("8", "four")


@pytest.mark.parametrize(
    ("world", "per_node", "message"),
    [
        (6, 4, "world_size=6 is not a multiple of ranks_per_node=4"),
        (0, 1, "world_size=0"),
        (4, 0, "ranks_per_node=0"),
        (-2, 1, "world_size=-2"),
        (4, 2.0, "ranks_per_node=2.0"),
        (True, 1, "world_size=True"),
    ],
)
def test_bad_sizes_are_named(world, per_node, message) -> None:
    with pytest.raises(ConfigError, match=message):
        Topology(world, per_node)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda t: t.node_of(8), "rank=8 out of range"),
        (lambda t: t.local_rank(-1), "rank=-1 out of range"),
        (lambda t: t.node_ranks(2), "node=2 out of range"),
        (lambda t: t.peer_ranks(4), "local_rank=4 out of range"),
    ],
)
def test_out_of_range_queries(call, message) -> None:
    with pytest.raises(ConfigError, match=message):
        call(Topology(8, 4))


@given(st.integers(1, 8), st.integers(1, 8))
def test_groups_partition_the_ranks(nodes: int, per_node: int) -> None:
    topo = Topology(nodes * per_node, per_node)
    for groups in (topo.intra_groups(), topo.inter_groups()):
        assert sorted(r for g in groups for r in g) == list(range(topo.world_size))
    # an intra group and an inter group meet in exactly one rank
    for intra in topo.intra_groups():
        for inter in topo.inter_groups():
            assert len(set(intra) & set(inter)) == 1
    for r in range(topo.world_size):
        assert r in topo.node_ranks(topo.node_of(r))
        assert r in topo.peer_ranks(topo.local_rank(r))


def test_ring_time_closed_form() -> None:
    # 2(p-1) alpha + 2(p-1)/p n / bw with p=4, n=1 GB, alpha=10 us, bw=10 GB/s
    assert ring_allreduce_time(1e9, 4, 1e-5, 1e10) == pytest.approx(6e-5 + 0.15)
    assert ring_allreduce_time(1e9, 1, 1e-5, 1e10) == 0.0
    with pytest.raises(ConfigError, match="bandwidth=0"):
        ring_allreduce_time(1.0, 2, 0.0, 0)


def test_hierarchical_time_is_intra_ring_plus_shard_ring() -> None:
    topo = Topology(8, 4)
    n, a_in, bw_in, a_out, bw_out = 4e8, 2e-6, 1e11, 2e-5, 1e10
    got = hierarchical_allreduce_time(n, topo, a_in, bw_in, a_out, bw_out)
    # intra: 2(k-1) alpha + 2(k-1)/k n / bw; inter: 2(N-1) alpha + 2(N-1)/N (n/k) / bw
    want = (6 * a_in + 1.5 * n / bw_in) + (2 * a_out + 1.0 * (n / 4) / bw_out)
    assert got == pytest.approx(want)
    # on a slow network it beats the flat ring priced at inter-node speed
    assert got < ring_allreduce_time(n, 8, a_out, bw_out)


def test_hierarchical_degenerates_to_a_ring() -> None:
    n = 1e6
    assert hierarchical_allreduce_time(n, Topology(4, 1), 1, 1, 1e-5, 1e9) == pytest.approx(
        ring_allreduce_time(n, 4, 1e-5, 1e9)
    )
    assert hierarchical_allreduce_time(n, Topology(4, 4), 1e-6, 1e10, 1, 1) == pytest.approx(
        ring_allreduce_time(n, 4, 1e-6, 1e10)
    )


@pytest.mark.parametrize(("nodes", "per_node"), [(2, 4), (4, 2), (8, 8), (2, 1)])
def test_inter_node_bytes_shrink_by_ranks_per_node(nodes: int, per_node: int) -> None:
    n = 1 << 20
    topo = Topology(nodes * per_node, per_node)
    hier = hierarchical_allreduce_bytes(n, topo)
    # the inter-node ring carries a 1/k shard: exactly 1/k of a flat ring over the nodes
    assert hier.inter == pytest.approx(ring_allreduce_bytes(n, nodes) / per_node)
    # and at least k times less than a flat ring over all ranks
    assert hier.inter * per_node <= ring_allreduce_bytes(n, topo.world_size)
    assert hier.intra == pytest.approx(2 * (per_node - 1) / per_node * n)


def test_literal_bytes_for_two_nodes_of_four() -> None:
    topo = Topology(8, 4)
    assert hierarchical_allreduce_bytes(400, topo) == (600.0, 100.0)
    # gloo runs the reduce-scatter as an intra-node allreduce: one more (k-1)*s
    assert hierarchical_allreduce_bytes(400, topo, reduce_scatter_as_allreduce=True) == (
        900.0,
        100.0,
    )
    assert ring_allreduce_bytes(400, 8) == 700.0


def test_bus_bandwidth_formula() -> None:
    # busbw = (n / T) * 2(p-1)/p
    assert bus_bandwidth(1e9, 0.5, 4) == pytest.approx(2e9 * 1.5)
    assert bus_bandwidth(1e9, 0.5, 1) == 0.0
    # a latency-free ring runs at exactly the link bandwidth
    t = ring_allreduce_time(3e8, 8, 0.0, 1e10)
    assert bus_bandwidth(3e8, t, 8) == pytest.approx(1e10)
    with pytest.raises(ConfigError, match="seconds=0"):
        bus_bandwidth(1.0, 0, 2)


def test_topology_module_does_not_import_torch() -> None:
    # syncline.comm's __init__ loads torch, so load the file on its own, as a pure module
    path = pathlib.Path(__file__).resolve().parents[2] / "syncline" / "comm" / "topology.py"
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('topology', {str(path)!r})\n"
        "mod = sys.modules['topology'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(mod)\n"
        "assert mod.Topology(4, 2).num_nodes == 2\n"
        "assert 'torch' not in sys.modules, 'torch was loaded'\n"
    )
    run_python(code)
