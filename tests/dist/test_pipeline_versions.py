"""2BW holds exactly two weight versions however ``train_step`` is called (issue 13).

Three calling patterns on 2 gloo ranks, each checked after every call by counting the live
tensors that hold the stage's largest weight (found by the garbage collector, not by the
pipeline's own bookkeeping) and against a single-process reference of the same updates:

- one batch per call (``train_step(iter([batch]))``): each call finishes its batch without
  starting another, so every batch runs on the newest weights (the flush rule);
- an iterator that ends mid-run, then a new one: the call that finds it exhausted finishes
  the batch in flight; the next iterator's first batch runs on the newest weights;
- ``flush()`` between calls of one iterator.

Before the fix, a run of one-batch calls kept every version it ever made (one stage copy
per call).
"""

from __future__ import annotations

import gc

import pytest
import torch

from syncline.models import lm_loss
from syncline.pipeline import Pipeline
from syncline.testing import run_ranks
from tests.zoo.models import LM_STEPS, lm_batches, lm_reference, tiny_gpt


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)  # no momentum buffer of the weight's shape


def _copies(weight: torch.Tensor) -> int:
    """Distinct storages of live tensors shaped like ``weight`` (its versions)."""
    gc.collect()
    ptrs = {
        o.untyped_storage().data_ptr()
        for o in gc.get_objects()
        if isinstance(o, torch.Tensor) and o.shape == weight.shape and o.dtype == weight.dtype
    }
    return len(ptrs)


def _drive(pipe: Pipeline, pattern: str, batches: list, counts: list[int]) -> list[float]:
    """Run ``pattern``'s calls; ``counts`` gets the copies of the stage's largest weight
    alive after each call (beyond those alive before the first call, less the one version
    the pipeline holds from its construction)."""
    losses: list[float] = []
    weight = max(pipe.stage_module.parameters(), key=lambda p: p.numel())  # a unique shape
    others = _copies(weight) - 1  # e.g. the state dicts of the patterns run before

    def after(loss: float | None) -> None:
        if loss is not None:
            losses.append(loss)
        counts.append(_copies(weight) - others)

    if pattern == "one-per-call":
        for batch in batches:
            after(pipe.train_step(iter([batch])))
    elif pattern == "ends-mid-run":
        for part in (batches[:3], batches[3:]):
            it = iter(part)
            for _ in part:
                after(pipe.train_step(it))
    else:  # flush after the second call of one iterator
        it = iter(batches)
        for call in range(LM_STEPS - 1):
            after(pipe.train_step(it))
            if call == 1:
                after(pipe.flush())
    after(pipe.flush())
    return losses


PATTERNS = {"one-per-call": range(LM_STEPS), "ends-mid-run": (0, 3), "flush-between": (0, 3)}


def _rank(rank: int, world: int) -> dict[str, dict]:
    out = {}
    for pattern in PATTERNS:
        pipe = Pipeline(
            tiny_gpt(),
            num_stages=2,
            num_microbatches=2,
            schedule="2bw",
            loss_fn=lm_loss,
            optimizer=_sgd,
            balance=[2, 2],
            timeout_s=30,
        )
        counts: list[int] = []
        losses = _drive(pipe, pattern, lm_batches(), counts)
        out[pattern] = {"counts": counts, "losses": losses, "state": pipe.local_state_dict()}
        del pipe
    return out


@pytest.fixture(scope="module")
def per_rank() -> list[dict]:
    return run_ranks(_rank, 2, timeout_s=120)


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_two_weight_versions_under_every_calling_pattern(per_rank, pattern) -> None:
    for rank, result in enumerate(per_rank):
        counts = result[pattern]["counts"]
        # two versions while a run goes on (the stage's Parameter aliases the newest), one
        # left after the final flush; a leak adds one per call
        assert max(counts) == 2 and counts[-1] == 1, (rank, counts)
    want_state, want_losses = lm_reference(
        _sgd, stale=True, flushed_before=PATTERNS[pattern]
    )
    state = {k: v for r in per_rank for k, v in r[pattern]["state"].items()}
    assert set(state) == set(want_state)
    for key, value in want_state.items():
        torch.testing.assert_close(state[key], value, atol=1e-5, rtol=0, msg=key)
    assert per_rank[0][pattern]["losses"] == pytest.approx(want_losses, abs=1e-5)
