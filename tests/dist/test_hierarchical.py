"""HierarchicalAllreduce on 4 gloo ranks == a flat allreduce, as 2x2, 1x4 and 4x1 nodes.

Every case runs in one spawn (each costs seconds): the rank function builds one collective per
layout and returns what the tests below check.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from syncline import DataParallel
from syncline.comm.collectives import FlatAllreduce
from syncline.comm.hierarchical import HierarchicalAllreduce
from syncline.comm.topology import Topology
from syncline.dp.registry import build_compressor
from syncline.errors import CommError, ConfigError
from syncline.testing import run_ranks

WORLD = 4
LAYOUTS = {"2x2": 2, "1x4": 4, "4x1": 1}  # name -> ranks per node
# (shape, dtype, transpose): odd sizes need padding, the transpose is non-contiguous
CASES = [
    ((1,), torch.float32, False),
    ((2,), torch.float32, False),
    ((3,), torch.float32, False),
    ((7,), torch.float32, False),
    ((1000,), torch.float32, False),
    ((1001,), torch.float64, False),
    ((3, 5), torch.float32, False),
    ((4, 6), torch.float32, True),
    ((9,), torch.int32, False),
]
STEPS, LR = 3, 0.1
#: compressors whose collective is an allreduce (the hierarchical one, when it is given)
COMPRESSORS = ("fp16", "csc:0.25:warmup=0:chunk=4", "powersgd:1:warmup=0")


def _input(rank: int, index: int) -> torch.Tensor:
    shape, dtype, transpose = CASES[index]
    g = torch.Generator().manual_seed(100 * index + rank)
    t = torch.randint(-1000, 1000, shape, generator=g).to(dtype)
    return t.t() if transpose else t


def _collectives(hier: HierarchicalAllreduce, flat: FlatAllreduce) -> dict:
    n = len(CASES)
    out: dict = {"one_by_one": [], "in_flight": [], "reversed_waits": [], "polled": [], "flat": []}
    for i in range(n):
        t = _input(hier.rank, i)
        hier.allreduce(t, f"case {i}").wait()
        out["one_by_one"].append(t)
        f = _input(hier.rank, i)
        flat.allreduce(f, f"flat case {i}").wait()
        out["flat"].append(f)
    # all cases in flight at once, waited in order
    tensors = [_input(hier.rank, i) for i in range(n)]
    pendings = [hier.allreduce(t, f"in-flight case {i}") for i, t in enumerate(tensors)]
    for p in pendings:
        p.wait()
    out["in_flight"] = tensors
    # waited last-first (the same on every rank): the first wait drains the whole queue
    tensors = [_input(hier.rank, i) for i in range(n)]
    pendings = [hier.allreduce(t, f"reversed case {i}") for i, t in enumerate(tensors)]
    for p in reversed(pendings):
        p.wait()
    out["reversed_waits"] = tensors
    # polled until every job's allgather runs, before any wait; ranks poll at different
    # moments (a rank-dependent pause), which must change only when, not in what order,
    # each group's collectives are issued
    tensors = [_input(hier.rank, i) for i in range(n)]
    before = dict(hier.early_starts)
    pendings = [hier.allreduce(t, f"polled case {i}") for i, t in enumerate(tensors)]
    deadline = time.monotonic() + 30
    while hier.early_starts[3] - before[3] < n * (not hier.is_flat):
        assert time.monotonic() < deadline, "poll() never advanced the phases"
        time.sleep(0.001 * (1 + hier.rank))
        hier.poll()
    out["early"] = {k: v - before[k] for k, v in hier.early_starts.items()}
    for p in pendings:
        p.wait()
    out["polled"] = tensors
    # bytes of one 1000-element float32 tensor (4000 bytes)
    pending = hier.allreduce(torch.ones(1000), "bytes probe")
    pending.wait()
    out["bytes"] = (hier.last_intra_node_bytes, hier.last_inter_node_bytes, pending.wire_bytes)
    return out


def _mlp() -> nn.Module:
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 3))


def _train(
    rank: int, allreduce: str | HierarchicalAllreduce, compression: str | None = None
) -> dict[str, torch.Tensor]:
    model = _mlp()
    # a tiny bucket cap gives several buckets, so several allreduces are in flight
    dp = DataParallel(
        model,
        bucket_cap_mb=0.0002,
        allreduce=allreduce,
        compression=None if compression is None else build_compressor(compression),
    )
    opt = torch.optim.SGD(dp.parameters(), LR, momentum=0.9)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
        lo = rank * 4
        opt.zero_grad()
        F.cross_entropy(dp(x[lo : lo + 4]), y[lo : lo + 4]).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _rank_main(rank: int, world: int) -> dict:
    out: dict = {"collectives": {}, "train": {}}
    try:
        HierarchicalAllreduce(Topology(8, 4)).build()
    except ConfigError as exc:
        out["mismatch"] = str(exc)
    flat = FlatAllreduce()
    for name, per_node in LAYOUTS.items():
        hier = HierarchicalAllreduce(Topology(world, per_node), timeout_s=30).build()
        out["collectives"][name] = _collectives(hier, flat)
        out["train"][name] = _train(rank, hier)
    out["train"]["flat"] = _train(rank, "flat")
    hier = HierarchicalAllreduce(Topology(world, 2), timeout_s=30).build()
    out["compressed"] = {
        spec: {"flat": _train(rank, "flat", spec), "2x2": _train(rank, hier, spec)}
        for spec in COMPRESSORS
    }
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(_rank_main, WORLD, timeout_s=120)


def _expected(index: int) -> torch.Tensor:
    return sum(_input(r, index) for r in range(WORLD))  # exact: small integers


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", ["one_by_one", "in_flight", "reversed_waits", "polled"])
def test_identical_to_flat_allreduce(results, layout: str, mode: str) -> None:
    for rank, per_rank in enumerate(results):
        got = per_rank["collectives"][layout]
        for i, (shape, dtype, transpose) in enumerate(CASES):
            tensor, flat = got[mode][i], got["flat"][i]
            assert tensor.dtype == dtype
            assert tensor.shape == (shape[::-1] if transpose else shape)
            assert torch.equal(tensor, flat), (rank, layout, mode, CASES[i])
            assert torch.equal(tensor, _expected(i)), (rank, layout, mode, CASES[i])


def test_bytes_split_by_link(results) -> None:
    for per_rank in results:
        # 2 nodes x 2: shard s = 2000 B; inter = 2(N-1)/N * s; intra = 2(k-1)s (gloo's
        # allreduce-based reduce-scatter) + (k-1)s (allgather)
        assert per_rank["collectives"]["2x2"]["bytes"] == (6000, 2000, 4000)
        # one node: a flat ring of 2(p-1)/p * n, all inside the node
        assert per_rank["collectives"]["1x4"]["bytes"] == (6000, 0, 4000)
        # one rank per node: the same ring, all across nodes
        assert per_rank["collectives"]["4x1"]["bytes"] == (0, 6000, 4000)
    # the inter-node share is the flat ring over the 2 nodes divided by k = 2
    assert 2000 == 2 * (2 - 1) / 2 * 4000 / 2


@pytest.mark.parametrize("layout", LAYOUTS)
def test_data_parallel_matches_flat(results, layout: str) -> None:
    start = _mlp().state_dict()
    for per_rank in results:
        want = per_rank["train"]["flat"]
        got = per_rank["train"][layout]
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, atol=1e-6, rtol=0, msg=key)
        assert not torch.equal(want["0.weight"], start["0.weight"])  # training moved
    # every rank holds the same model
    for per_rank in results[1:]:
        for key, value in results[0]["train"][layout].items():
            assert torch.equal(per_rank["train"][layout][key], value)


def test_topology_must_match_the_group(results) -> None:
    assert "Topology(world_size=8, ranks_per_node=4)" in results[0]["mismatch"]
    assert "world_size=4" in results[0]["mismatch"]


def test_collective_needs_build_first() -> None:
    hier = HierarchicalAllreduce(Topology(4, 2))
    with pytest.raises(CommError, match="call build"):
        hier.allreduce(torch.zeros(3), "early")
    with pytest.raises(ConfigError, match="timeout_s=0"):
        HierarchicalAllreduce(Topology(4, 2), timeout_s=0)


def test_poll_starts_later_phases_before_any_wait(results) -> None:
    """Phases 2 and 3 of every job started from poll() alone (2x2: the one layout with all
    three phases), so they can overlap backward; the sums are checked above."""
    n = len(CASES)
    for per_rank in results:
        assert per_rank["collectives"]["2x2"]["early"] == {2: n, 3: n}
        assert per_rank["collectives"]["1x4"]["early"] == {2: 0, 3: 0}  # flat: no phases


@pytest.mark.parametrize("spec", COMPRESSORS)
def test_compressors_run_over_the_hierarchical_allreduce(results, spec: str) -> None:
    """A compressor's collectives go through the hierarchical allreduce (each phase moving
    the compressed payload): training matches the same compressor on a flat ring up to the
    order of additions, and every rank holds the same model."""
    start = _mlp().state_dict()
    for per_rank in results:
        got = per_rank["compressed"][spec]
        for key, value in got["flat"].items():
            torch.testing.assert_close(got["2x2"][key], value, atol=1e-3, rtol=0, msg=key)
        assert not torch.equal(got["2x2"]["0.weight"], start["0.weight"])
    for per_rank in results[1:]:
        for key, value in results[0]["compressed"][spec]["2x2"].items():
            assert torch.equal(per_rank["compressed"][spec]["2x2"][key], value), (spec, key)
