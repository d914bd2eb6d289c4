"""A pipeline of a model built on the meta device (issue 13): each rank materialises only
its stages, the weights do not depend on the depth, and training matches one process.

Depth 2 (the split profiled on rank 0, one layer at a time) and depth 4 (given): no rank
allocates another stage's layers (they stay on the meta device), and after three 1F1B steps
the union of the ranks' weights equals one process trained from ``materialize(model)``'s
weights (so the stages started from exactly those).
"""

from __future__ import annotations

import pytest
import torch

from syncline.models import build_gpt, gpt_layer_init, lm_loss, materialize
from syncline.models.configs import GPTConfig
from syncline.pipeline import Pipeline
from syncline.testing import run_ranks
from tests.zoo.models import lm_batches, reference_training
from tests.zoo.schedules import optimizer

CFG = GPTConfig(n_layer=2, n_embd=16, n_head=2, block_size=8)
SEED = 3


def _meta():
    with torch.device("meta"):
        return build_gpt(CFG)


def _rank(rank: int, world: int) -> dict:
    model = _meta()
    pipe = Pipeline(
        model,
        num_stages=world,
        num_microbatches=4,
        schedule="1f1b",
        loss_fn=lm_loss,
        optimizer=optimizer("sgd"),
        balance=None if world == 2 else [1, 1, 1, 1],
        init=gpt_layer_init(CFG),
        seed=SEED,
        timeout_s=60,
    )
    batches = iter(lm_batches()[:3])
    pipe.train_step(batches)  # with balance=None the stages are built (and profiled) here
    mine = set(pipe.local_state_dict())
    elsewhere = [n for n, p in model.named_parameters() if n not in mine and not p.is_meta]
    for _ in range(2):
        pipe.train_step(batches)
    return {"state": pipe.local_state_dict(), "elsewhere": elsewhere, "balance": pipe.balance}


@pytest.mark.parametrize("world", [2, 4])
def test_meta_pipeline_materialises_its_stages_and_trains_as_one_process(world) -> None:
    per_rank = run_ranks(_rank, world, timeout_s=150)
    assert all(r["elsewhere"] == [] for r in per_rank)  # no rank allocated others' layers
    assert len({tuple(r["balance"]) for r in per_rank}) == 1
    reference = materialize(_meta(), seed=SEED, init=gpt_layer_init(CFG))
    reference_training(reference, optimizer("sgd"), lm_batches()[:3], lm_loss, stale=False)
    want = reference.state_dict()
    got = {k: v for r in per_rank for k, v in r["state"].items()}
    assert got.keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, atol=1e-5, rtol=0, msg=key)
