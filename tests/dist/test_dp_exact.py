"""DataParallel on N gloo ranks == one process on the whole batch (and DDP agrees)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from syncline import DataParallel
from syncline.testing import RankFailure, run_ranks
from tests.zoo.models import TOY_MODELS, toy_batch, toy_model

STEPS = 4
TUNED_STEPS = 14  # bucket tuning (1 step per candidate, twice at most) ends inside this run
GLOBAL_BATCH = 8
LR, MOMENTUM = 0.1, 0.9
CASES = tuple(TOY_MODELS)  # frozen, tied, unused, bn


@dataclass(frozen=True)
class Run:
    """One spawn: every toy model trained by ``kind`` on ``world`` ranks, each rank's shard cut
    into ``accumulate`` micro-batches (all but the last under ``no_sync``)."""

    kind: str  # "syncline", "syncline-lean" (gradient_as_bucket_view), "ddp"
    world: int
    accumulate: int

    @property
    def id(self) -> str:
        return f"{self.kind}-{self.world}ranks-accumulate{self.accumulate}"


RUNS = [
    Run("syncline", 2, 1),
    Run("ddp", 2, 1),
    Run("syncline", 4, 1),
    Run("syncline", 2, 2),
    Run("syncline-lean", 2, 2),
]


def _wrap(kind: str, model: torch.nn.Module, name: str) -> torch.nn.Module:
    unused = name == "unused"
    if kind == "syncline-tuned":
        # measured bucket plans, switched between steps: each candidate once, then the winner
        return DataParallel(
            model,
            find_unused_parameters=unused,
            autotune_buckets=True,
            tune_steps_per_trial=1,
            tune_rounds=1,
            tune_final_rounds=1,
            tune_keep_margin=1e6,  # all survive the screening: the second phase runs too
            tune_min_bucket_mb=0.00005,
        )
    if kind.startswith("syncline"):
        # a tiny bucket cap forces several buckets, so ordering and flushing are exercised;
        # "syncline-lean" frees autograd's gradients at once instead of at the next forward
        return DataParallel(
            model,
            find_unused_parameters=unused,
            bucket_cap_mb=0.0005,
            gradient_as_bucket_view=kind == "syncline-lean",
        )
    return DDP(model, find_unused_parameters=unused, bucket_cap_mb=0.0005)


def _train_rank(
    rank: int, world: int, kind: str, accumulate: int, steps: int = STEPS
) -> dict[str, dict]:
    out: dict[str, dict] = {"tuning": {}}
    for name in CASES:
        model = toy_model(name)
        dp = _wrap(kind, model, name)
        opt = torch.optim.SGD([p for p in dp.parameters() if p.requires_grad], LR, MOMENTUM)
        local = GLOBAL_BATCH // world
        for step in range(steps):
            model.step = step
            opt.zero_grad()
            micro = local // accumulate
            for k in range(accumulate):
                x, y = toy_batch(name, step, GLOBAL_BATCH)
                lo = rank * local + k * micro
                xs, ys = x[lo : lo + micro], y[lo : lo + micro]
                if k < accumulate - 1:
                    with dp.no_sync():
                        (F.cross_entropy(dp(xs), ys) / accumulate).backward()
                else:
                    (F.cross_entropy(dp(xs), ys) / accumulate).backward()
            opt.step()
        out[name] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        out["tuning"][name] = getattr(dp, "bucket_tuning", None)
    return out


def _reference(
    name: str, world: int, accumulate: int, steps: int = STEPS
) -> dict[str, torch.Tensor]:
    """One process: each step, the mean of the per-shard losses (shards as the ranks see them,
    cut into ``accumulate`` micro-batches each).

    Rank 0's BatchNorm buffers are what DDP-style buffer broadcast keeps, so only shard 0
    updates the running statistics; the other shards run on a throw-away copy.
    """
    model = toy_model(name)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], LR, MOMENTUM)
    local = GLOBAL_BATCH // world
    for step in range(steps):
        model.step = step
        opt.zero_grad()
        x, y = toy_batch(name, step, GLOBAL_BATCH)
        micro = local // accumulate
        for r in range(world):
            for k in range(accumulate):
                lo = r * local + k * micro
                xs, ys = x[lo : lo + micro], y[lo : lo + micro]
                saved = copy.deepcopy(list(model.buffers())) if r > 0 else None
                (F.cross_entropy(model(xs), ys) / (world * accumulate)).backward()
                if saved is not None:
                    for b, s in zip(model.buffers(), saved, strict=True):
                        b.copy_(s)
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def results() -> dict[Run, list[dict]]:
    return {run: run_ranks(_train_rank, run.world, run.kind, run.accumulate) for run in RUNS}


def _assert_state_equal(got: dict, want: dict, buffers_too: bool) -> None:
    for key, value in want.items():
        if not buffers_too and ("running" in key or "num_batches" in key):
            continue
        torch.testing.assert_close(got[key], value, atol=1e-5, rtol=0, msg=key)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("run", RUNS, ids=lambda run: run.id)
def test_matches_single_process(results, run: Run, name: str) -> None:
    want = _reference(name, run.world, run.accumulate)
    per_rank = results[run]
    for rank, states in enumerate(per_rank):
        _assert_state_equal(states[name], want, buffers_too=rank == 0)
    # the reference really moved: a no-op engine could not pass
    start = toy_model(name).state_dict()
    moved = [k for k in start if "weight" in k and not torch.equal(start[k], want[k])]
    assert moved


def test_bucket_tuning_matches_single_process() -> None:
    """Re-cutting the buckets between steps (tuning, then the winner) keeps every update exact,
    and every rank picks the same plan."""
    per_rank = run_ranks(_train_rank, 2, "syncline-tuned", 1, TUNED_STEPS)
    for name in CASES:
        want = _reference(name, 2, 1, TUNED_STEPS)
        for rank, states in enumerate(per_rank):
            _assert_state_equal(states[name], want, buffers_too=rank == 0)
        tuning = [states["tuning"][name] for states in per_rank]
        assert tuning[0] is not None and len(tuning[0]["candidates"]) >= 2, tuning[0]
        assert tuning[0]["decided_at"] < TUNED_STEPS - 1  # steps ran on the chosen plan too
        assert tuning[1]["chosen"] == tuning[0]["chosen"]
        sizes = {c["buckets"] for c in tuning[0]["candidates"]}
        assert len(sizes) >= 2  # the candidates really cut the buffer differently
        assert all(c["steps"] == 2 and c["final"] for c in tuning[0]["candidates"])


def test_training_moves_frozen_nothing(results) -> None:
    start = toy_model("frozen").state_dict()
    for states in results[Run("syncline", 2, 1)]:
        assert torch.equal(states["frozen"]["a.weight"], start["a.weight"])


def _unused_without_flag(rank: int, world: int) -> None:
    model = DataParallel(toy_model("unused"))
    x, y = toy_batch("unused", 0, 4)
    F.cross_entropy(model(x), y).backward()


def test_unused_parameter_without_flag_is_a_clear_error() -> None:
    with pytest.raises(RankFailure, match="find_unused_parameters=True"):
        run_ranks(_unused_without_flag, 2)
