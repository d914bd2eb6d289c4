"""Third-party models as their users build them train unchanged, on real gloo ranks.

A HuggingFace BERT (masked LM) and a small Llama (causal LM), each from its default config
with only the size shrunk (Llama's ``use_cache=True`` left as built), and an LM of torch's own
``nn.TransformerEncoder`` built on the meta device and given no ``init``:

- ``Pipeline(split_points=...)`` of 2 stages under 1F1B and 2BW reproduces a one-process
  reference on the same micro-batches (2BW: the delayed-gradient rule) to 1e-5;
- ``DataParallel`` gives the gradients and weights of torch's ``DistributedDataParallel``
  bit for bit.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from syncline import DataParallel
from syncline.models.meta_modules import materialize_modules
from syncline.pipeline import Pipeline
from syncline.testing import run_ranks
from tests.zoo import hf

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # ~50 s: three models, four runs each, on 2 ranks

STEPS, BATCH, M, SEED = 4, 8, 4, 5
LR, MOMENTUM = 0.1, 0.9
MODELS: dict[str, tuple[Callable[[], torch.nn.Module], list[str], Callable, Callable]] = {
    "bert": (hf.bert, ["bert.encoder.layer.1"], hf.masked_loss, hf.masked_batches),
    "llama": (hf.llama, ["model.layers.1"], hf.causal_loss, hf.causal_batches),
    "encoder": (hf.meta_encoder, ["body.layers.1"], hf.causal_loss, hf.ids_batches),
}
SCHEDULES = ("1f1b", "2bw")


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def _built(name: str) -> torch.nn.Module:
    """The model as the one-process reference and data parallelism start from (the meta one
    materialised whole, as a pipeline materialises each rank's stage: by module name)."""
    model = MODELS[name][0]()
    if next(model.parameters()).is_meta:
        materialize_modules(model, seed=SEED)
    return model


def _pipeline(name: str, schedule: str) -> dict[str, Any]:
    build, points, loss_fn, batches = MODELS[name]
    pipe = Pipeline(
        build(), num_stages=2, num_microbatches=M, schedule=schedule, loss_fn=loss_fn,
        optimizer=_optimizer, split_points=points, timeout_s=60, seed=SEED,
    )  # fmt: skip
    it = iter(batches(STEPS + 1, BATCH))
    losses = [pipe.train_step(it) for _ in range(STEPS)]
    losses.append(pipe.flush() if schedule == "2bw" else pipe.train_step(it))
    return {"losses": losses, "state": pipe.local_state_dict()}


def _data_parallel(name: str, kind: str, rank: int, world: int) -> dict[str, Any]:
    _, _, loss_fn, batches = MODELS[name]
    model = _built(name)
    with warnings.catch_warnings():  # DDP 2.13: broadcast_buffers is deprecated
        warnings.simplefilter("ignore", FutureWarning)
        wrapped = DDP(model) if kind == "ddp" else DataParallel(model)
    opt = _optimizer(model.parameters())
    grads = []
    for inputs, target in batches(STEPS, BATCH):
        rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
        opt.zero_grad()
        out = wrapped(**{k: v[rows] for k, v in inputs.items()})
        loss_fn(hf.logits(out), target[rows]).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return {"grads": grads, "state": {k: v.clone() for k, v in model.state_dict().items()}}


def _rank(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in MODELS:
        for schedule in SCHEDULES:
            out[f"{name}-{schedule}"] = _pipeline(name, schedule)
        for kind in ("ddp", "syncline"):
            out[f"{name}-{kind}"] = _data_parallel(name, kind, rank, world)
    return out


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_ranks(_rank, 2, timeout_s=300)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("name", list(MODELS))
def test_a_two_stage_pipeline_matches_one_process(two_ranks, name: str, schedule: str) -> None:
    _, _, loss_fn, batches = MODELS[name]
    model = _built(name)
    want_losses = hf.microbatch_reference(
        model, _optimizer, batches(STEPS + 1, BATCH), loss_fn, M, stale=schedule == "2bw"
    )
    runs = [r[f"{name}-{schedule}"] for r in two_ranks]
    first, last = (set(r["state"]) for r in runs)
    assert first and last and not first & last  # each rank holds its own stage only
    state = {**runs[0]["state"], **runs[1]["state"]}
    # everything a checkpoint holds, under one of its names at least (a tied parameter,
    # BERT's embedding and decoder, once on each stage that uses it); buffers that are not
    # checkpointed may be there too (BERT's position ids) or not, when no stage reads them
    # (Llama's original rotary frequencies)
    named = [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]
    want = dict(named)
    assert state.keys() <= want.keys()
    checkpointed = {id(t) for t in model.state_dict(keep_vars=True).values()}
    assert checkpointed <= {id(want[k]) for k in state}
    for key, value in state.items():
        torch.testing.assert_close(value, want[key], atol=1e-5, rtol=0, msg=key)
    for r in runs:
        assert r["losses"] == pytest.approx(want_losses, abs=1e-5)


@pytest.mark.parametrize("name", list(MODELS))
def test_data_parallel_equals_ddp_bit_for_bit(two_ranks, name: str) -> None:
    for r in two_ranks:
        ddp, ours = r[f"{name}-ddp"], r[f"{name}-syncline"]
        for step, (want, got) in enumerate(zip(ddp["grads"], ours["grads"], strict=True)):
            assert want.keys() == got.keys()
            for key, value in want.items():
                assert torch.equal(got[key], value), (name, step, key)
        for key, value in ddp["state"].items():
            assert torch.equal(ours["state"][key], value), (name, key)
