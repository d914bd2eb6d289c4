"""Pipelines x data-parallel replicas on 4 gloo ranks (2 stages x 2 replicas) == one process
on the whole batch (2BW: the stale rule); fp16 REDUCE close to the dense one; bad groups fail.

One spawn runs every case of the schedule zoo (``tests.zoo.schedules.REPLICAS``). Each replica
trains on its half of every global batch of the model zoo's ``lm_batches``, whose
single-process references (the unsplit model on the whole batch) are the pipeline parity
tests' too, so the averaged gradients must equal the whole batch's. The last case
breaks the groups on purpose (a replica that starts late), so it runs last.
"""

from __future__ import annotations

import math
import time

import pytest
import torch

from syncline import comm
from syncline.dp.compressors import FP16, PowerSGD
from syncline.errors import CommError, ConfigError
from syncline.models import lm_loss
from syncline.pipeline import Pipeline, StageError
from syncline.testing import run_ranks
from tests.zoo import schedules
from tests.zoo.models import LM_STEPS, lm_batches, tiny_gpt

WORLD, DEPTH = 4, 2
WIDTH = WORLD // DEPTH
#: REDUCE buckets of ~100 bytes: several per stage (a bucket closes once it holds at least
#: that much, as DataParallel's do), each started inside the last backward
SMALL_BUCKETS = {"1f1b-buckets": "1f1b", "2bw-buckets": "2bw", "interleaved-buckets": "interleaved"}
CASES = {
    **schedules.REPLICAS,
    **{name: schedules.REPLICAS[base] for name, base in SMALL_BUCKETS.items()},
}


def _shard(replica: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This replica's half of every global batch."""
    out = []
    for x, y in lm_batches():
        n = x.shape[0] // WIDTH
        out.append((x[replica * n : (replica + 1) * n], y[replica * n : (replica + 1) * n]))
    return out


def _train(name: str, pipe_group: comm.Group, dp_group: comm.Group) -> dict:
    case = CASES[name]
    pipe = case.pipeline(
        process_group=pipe_group,
        data_parallel_group=dp_group,
        compression={"fp16": FP16(), "powersgd": PowerSGD(rank=1)}.get(case.compression or ""),
        timeout_s=30,
        reduce_bucket_mb=0.0001 if name in SMALL_BUCKETS else 4.0,
    )
    batches = iter(_shard(comm.group_rank(dp_group)))
    losses = [pipe.train_step(batches) for _ in range(LM_STEPS - 1)]
    losses.append(pipe.flush() if case.schedule == "2bw" else pipe.train_step(batches))
    return {
        "state": pipe.local_state_dict(),
        "losses": losses,
        "balance": pipe.balance,
        "compression": pipe.compression.state_dict(),
        "shapes": [tuple(p.shape) for p in pipe.stage_module.parameters()],
        "early_buckets": pipe.early_reduce_buckets,
        "buckets": {s: r.num_buckets for s, r in pipe._ctx.replicas._reducers.items()},
    }


def _bad_layouts(pipe_group: comm.Group, dp_group: comm.Group) -> list[str]:
    """Each misuse must raise ConfigError on every rank before any communication."""
    attempts = [
        lambda: comm.build_pipeline_groups(3),
        lambda: _train_with(process_group=None, data_parallel_group=dp_group),
        lambda: _train_with(process_group=pipe_group, data_parallel_group=pipe_group),
    ]
    messages = []
    for attempt in attempts:
        try:
            attempt()
        except ConfigError as exc:
            messages.append(str(exc))
        else:
            messages.append("no error")
    return messages


def _train_with(timeout_s: float = 30.0, **groups: comm.Group) -> Pipeline:
    return Pipeline(
        tiny_gpt(),
        num_stages=2,
        num_microbatches=2,
        loss_fn=lm_loss,
        optimizer=schedules.optimizer("sgd"),
        balance=[2, 2],
        timeout_s=timeout_s,
        **groups,
    )


def _late_replica(pipe_group: comm.Group, dp_group: comm.Group) -> str:
    """Replica 1 starts its first step 3 s late: replica 0 waits in its REDUCE and times out.
    Both build their stages first (the replicas' weight broadcast), on time."""
    pipe = _train_with(timeout_s=1.0, process_group=pipe_group, data_parallel_group=dp_group)
    replica = comm.group_rank(dp_group)
    pipe.prepare(_shard(replica)[0])
    if replica == 1:
        time.sleep(3.0)
    try:
        pipe.train_step(iter(_shard(replica)))
    except (CommError, StageError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _rank(rank: int, world: int) -> dict:
    pipe_group, dp_group = comm.build_pipeline_groups(DEPTH, timeout_s=30)
    out = {
        "groups": (comm.group_ranks(pipe_group), comm.group_ranks(dp_group)),
        "bad": _bad_layouts(pipe_group, dp_group),
    }
    for name in CASES:
        out[name] = _train(name, pipe_group, dp_group)
    out["late"] = _late_replica(pipe_group, dp_group)  # last: leaves the groups broken
    return out


@pytest.fixture(scope="module")
def per_rank() -> list[dict]:
    return run_ranks(_rank, WORLD, timeout_s=150)


def _merged(per_rank: list[dict], name: str, replica: int) -> dict[str, torch.Tensor]:
    """The full model of one replica: the union of its pipeline's ranks' stages."""
    state: dict[str, torch.Tensor] = {}
    for rank in range(replica, WORLD, WIDTH):
        state.update(per_rank[rank][name]["state"])
    return state


def test_groups_put_replicas_of_a_stage_on_consecutive_ranks(per_rank) -> None:
    assert [r["groups"] for r in per_rank] == [
        ((0, 2), (0, 1)),
        ((1, 3), (0, 1)),
        ((0, 2), (2, 3)),
        ((1, 3), (2, 3)),
    ]


@pytest.mark.parametrize("name", [n for n, case in CASES.items() if case.compression is None])
def test_replicas_match_one_process_on_the_whole_batch(per_rank, name: str) -> None:
    want_state, want_losses = CASES[name].reference()
    for replica in range(WIDTH):
        state = _merged(per_rank, name, replica)
        assert set(state) == set(want_state), name
        for key, value in want_state.items():
            torch.testing.assert_close(
                state[key], value, atol=1e-5, rtol=0, msg=f"{name} replica {replica} {key}"
            )
    for r in per_rank:  # every rank returns the loss averaged over the replicas
        assert r[name]["losses"] == pytest.approx(want_losses, abs=1e-5), name


@pytest.mark.parametrize("name", ["1f1b", *SMALL_BUCKETS])
def test_every_reduce_bucket_starts_inside_the_last_backward(per_rank, name: str) -> None:
    """Each stage's REDUCE buckets (one per stage by default, several at ~100 bytes) all start
    from the backward hooks, none at the REDUCE action: every parameter of these stages
    gets its gradient in every micro-batch. (That they average exactly: the test above.)"""
    for r in per_rank:
        buckets = r[name]["buckets"]
        if name in SMALL_BUCKETS:
            assert all(n > 1 for n in buckets.values()), buckets
        else:
            assert all(n == 1 for n in buckets.values()), buckets
        assert r[name]["early_buckets"] == LM_STEPS * sum(buckets.values())


def test_replicas_agree_on_a_profiled_balance(per_rank) -> None:
    splits = [r["1f1b-profiled"]["balance"] for r in per_rank]
    assert all(split == splits[0] for split in splits) and sum(splits[0]) == 4, splits


def test_fp16_reduce_is_close_to_the_dense_one(per_rank) -> None:
    for replica in range(WIDTH):
        dense, half = _merged(per_rank, "2bw", replica), _merged(per_rank, "2bw-fp16", replica)
        for key, value in dense.items():
            torch.testing.assert_close(half[key], value, atol=2e-3, rtol=0, msg=key)
        assert any(not torch.equal(half[k], dense[k]) for k in dense), "fp16 changed nothing"
    # the replicas still agree exactly: every one applied the same averaged gradient
    first, second = _merged(per_rank, "2bw-fp16", 0), _merged(per_rank, "2bw-fp16", 1)
    for key, value in first.items():
        assert torch.equal(second[key], value), key


def test_powersgd_reduce_compresses_each_weight_matrix_of_a_stage(per_rank) -> None:
    """The REDUCE hands PowerSGD the stage's layout: one rank-1 factor pair per weight matrix
    whose factors are >= 2x smaller (Vogels et al.; DDP's hook), not one for the whole buffer."""
    for r in per_rank:
        matrices = [(s[0], math.prod(s[1:])) for s in r["1f1b-powersgd"]["shapes"] if len(s) >= 2]
        q_numel = sum(cols for rows, cols in matrices if 2 * (rows + cols) < rows * cols)
        (bucket,) = r["1f1b-powersgd"]["compression"]["buckets"].values()
        assert q_numel > 0 and bucket["q"].numel() == q_numel
    dense = _merged(per_rank, "1f1b", 0)
    first, second = _merged(per_rank, "1f1b-powersgd", 0), _merged(per_rank, "1f1b-powersgd", 1)
    assert any(not torch.equal(first[k], dense[k]) for k in dense), "PowerSGD changed nothing"
    for key, value in first.items():  # every replica applied the same decompressed average
        assert torch.equal(second[key], value), key


def test_bad_layouts_raise_config_errors_naming_the_values(per_rank) -> None:
    for rank, r in enumerate(per_rank):
        indivisible, world_as_pipeline, same_group = r["bad"]
        assert "world_size=4 is not divisible by num_stages=3" in indivisible
        dp = (0, 1) if rank < 2 else (2, 3)
        assert f"data_parallel_group ranks {dp}" in world_as_pipeline
        assert "process_group ranks (0, 1, 2, 3)" in world_as_pipeline
        pipe = (0, 2) if rank % 2 == 0 else (1, 3)
        assert f"share ranks {list(pipe)}" in same_group


def test_a_late_replica_times_out_its_peers_naming_rank_step_and_action(per_rank) -> None:
    for rank, stage in ((0, 0), (2, 1)):
        error = per_rank[rank]["late"]
        assert error.startswith(
            f"CommTimeout: rank {rank}: REDUCE of stage {stage} at step 0 over data-parallel "
            f"ranks ({rank}, {rank + 1}) failed: rank {rank}: "
        ), error
        assert "did not complete within 1s" in error, error
    for rank in (1, 3):  # their peers are gone: they fail too, instead of hanging
        assert per_rank[rank]["late"] != "no error"
