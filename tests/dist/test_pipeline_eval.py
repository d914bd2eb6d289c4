"""Forward-only use of a pipeline (issue 13): ``eval_step`` and ``predict``.

On 2 gloo ranks, for GPipe-style 1F1B, 2BW (evaluated between two calls, with the next batch
already in flight) and interleaved stages: the loss and the outputs every rank returns equal
the unsplit model's on the newest weights, and evaluating in the middle of training leaves
the training itself bit-identical to a run without it.
"""

from __future__ import annotations

import pytest
import torch

from syncline.models import lm_loss
from syncline.pipeline import Pipeline
from syncline.testing import run_ranks
from tests.zoo.models import lm_batches, tiny_gpt
from tests.zoo.schedules import optimizer

CASES = {
    "1f1b": {"schedule": "1f1b", "num_stages": 2, "balance": [2, 2]},
    "2bw": {"schedule": "2bw", "num_stages": 2, "balance": [1, 3]},
    "interleaved": {"schedule": "interleaved", "num_stages": 4, "balance": [1, 1, 1, 1]},
}


def _pipe(case: dict) -> Pipeline:
    return Pipeline(
        tiny_gpt(),
        num_microbatches=4,
        loss_fn=lm_loss,
        optimizer=optimizer("sgd"),
        timeout_s=30,
        **case,
    )


def _rank(rank: int, world: int) -> dict[str, dict]:
    out = {}
    batches = lm_batches()
    probe = batches[1]
    for name, case in CASES.items():
        runs = {}
        for evaluate in (True, False):
            pipe = _pipe(case)
            it, got = iter(batches[:4]), {}
            for call in range(3):
                pipe.train_step(it)
                if evaluate and call == 1:  # under 2BW, batch 2 is in flight here
                    got["loss"] = pipe.eval_step(iter([probe]))
                    got["outputs"] = pipe.predict(probe[0])
                    got["state"] = pipe.local_state_dict()
                    got["training"] = pipe.stage_module.training
            pipe.flush()
            got["final"] = pipe.local_state_dict()
            runs[evaluate] = got
        out[name] = runs
    return out


@pytest.fixture(scope="module")
def per_rank() -> list[dict]:
    return run_ranks(_rank, 2, timeout_s=150)


@pytest.mark.parametrize("name", sorted(CASES))
def test_eval_step_and_predict_match_the_unsplit_model(per_rank, name) -> None:
    model = tiny_gpt()
    state = {k: v for r in per_rank for k, v in r[name][True]["state"].items()}
    model.load_state_dict(state)
    model.eval()
    x, y = lm_batches()[1]
    with torch.no_grad():
        logits = model(x)
        # the pipeline's loss is the mean over 4 equal micro-batches' means
        want = torch.stack([lm_loss(o, t) for o, t in zip(logits.chunk(4), y.chunk(4), strict=True)])
    for r in per_rank:
        got = r[name][True]
        assert got["loss"] == pytest.approx(float(want.double().mean()), abs=1e-6)
        torch.testing.assert_close(got["outputs"], logits, atol=1e-5, rtol=0)
        assert got["training"] is True  # the stage modules' mode is restored


@pytest.mark.parametrize("name", sorted(CASES))
def test_evaluating_mid_training_changes_nothing(per_rank, name) -> None:
    for r in per_rank:
        with_eval, without = r[name][True]["final"], r[name][False]["final"]
        assert with_eval.keys() == without.keys()
        for k in with_eval:
            assert torch.equal(with_eval[k], without[k]), k
