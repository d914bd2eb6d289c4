"""A pipeline's replicas that span nodes average through the hierarchical allreduce.

8 gloo ranks as 4 emulated nodes of 2 (``ranks_per_node=2``): 2 stages x 4 replicas, so each
stage's replicas (4 consecutive ranks) sit 2 per node on 2 nodes, and their REDUCE runs the
three phases (in the node, across, in the node) over subgroups that every rank created. It
must train as the flat ring does up to the order of additions (lossless: within 1e-6; CSC,
whose fp16 payload rounds the other order's partial sums: within 1e-3, measured 2e-4), with
the replicas identical, under 1F1B and 2BW.
"""

from __future__ import annotations

import pytest
import torch

from syncline import comm
from syncline.comm.hierarchical import HierarchicalAllreduce
from syncline.comm.registry import build_allreduce
from syncline.dp.registry import build_compressor
from syncline.errors import ConfigError
from syncline.models import lm_loss
from syncline.pipeline import Pipeline
from syncline.testing import run_ranks
from tests.zoo import schedules
from tests.zoo.models import LM_STEPS, lm_batches, tiny_gpt

WORLD, DEPTH, PER_NODE = 8, 2, 2
WIDTH = WORLD // DEPTH
CASES = {"1f1b": ("1f1b", None), "2bw": ("2bw", None), "2bw-csc": ("2bw", "csc:0.5:warmup=0")}


def _shard(replica: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for x, y in lm_batches():
        n = x.shape[0] // WIDTH
        out.append((x[replica * n : (replica + 1) * n], y[replica * n : (replica + 1) * n]))
    return out


def _train(schedule: str, spec: str | None, pipe_group, dp_group, allreduce) -> dict:
    pipe = Pipeline(
        tiny_gpt(),
        num_stages=DEPTH,
        num_microbatches=2,
        schedule=schedule,
        loss_fn=lm_loss,
        optimizer=schedules.optimizer("sgd"),
        balance=[2, 2],
        process_group=pipe_group,
        data_parallel_group=dp_group,
        compression=None if spec is None else build_compressor(spec),
        replica_allreduce=allreduce,
        reduce_bucket_mb=0.001,
        timeout_s=60,
    )
    batches = iter(_shard(comm.group_rank(dp_group)))
    for _ in range(LM_STEPS - 1):
        pipe.train_step(batches)
    if schedule == "2bw":
        pipe.flush()
    else:
        pipe.train_step(batches)
    return pipe.local_state_dict()


def _rank(rank: int, world: int) -> dict:
    pipe_group, dp_group = comm.build_pipeline_groups(DEPTH, timeout_s=60)
    hier = build_allreduce("hierarchical", dp_group, timeout_s=60, ranks_per_node=PER_NODE)
    assert isinstance(hier, HierarchicalAllreduce)
    out: dict = {"flat_layout": hier.is_flat, "dp": comm.group_ranks(dp_group)}
    for name, (schedule, spec) in CASES.items():
        out[name] = {
            "flat": _train(schedule, spec, pipe_group, dp_group, None),
            "hier": _train(schedule, spec, pipe_group, dp_group, hier),
        }
    try:  # nodes of 3 split the replicas (0..3) 3 + 1: refused on every rank, no group made
        build_allreduce("hierarchical", dp_group, timeout_s=60, ranks_per_node=3)
        out["uneven"] = "no error"
    except ConfigError as exc:
        out["uneven"] = str(exc)
    return out


@pytest.fixture(scope="module")
def per_rank() -> list[dict]:
    return run_ranks(_rank, WORLD, timeout_s=240)


@pytest.mark.parametrize("name", CASES)
def test_hierarchical_replicas_train_as_the_flat_ring(per_rank, name: str) -> None:
    for r in per_rank:
        assert r["flat_layout"] is False and len(r["dp"]) == WIDTH
        flat, hier = r[name]["flat"], r[name]["hier"]
        assert set(flat) == set(hier)
        atol = 1e-3 if CASES[name][1] else 1e-6
        for key, value in flat.items():
            torch.testing.assert_close(hier[key], value, atol=atol, rtol=0, msg=key)
    for rank in range(WORLD):  # the replicas of a stage hold the same weights
        first = per_rank[rank - rank % WIDTH][name]["hier"]
        for key, value in per_rank[rank][name]["hier"].items():
            assert torch.equal(value, first[key]), (rank, key)


def test_a_group_spread_unevenly_on_nodes_is_refused_naming_it(per_rank) -> None:
    for r in per_rank:
        assert "sit unevenly on nodes of 3" in r["uneven"], r["uneven"]
        assert "valid: allreduce='flat'" in r["uneven"]
