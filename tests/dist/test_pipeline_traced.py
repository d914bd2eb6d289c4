"""Any model split at named modules, trained by syncline's schedules on real gloo ranks.

A HuggingFace GPT-2 built from a small config (tied input embedding and output head kept, an
attention mask with padding as a keyword input, two values crossing each split, one of them
boolean and read two stages later) and a HuggingFace ResNet (BatchNorm, residual branches)
are given to ``Pipeline`` with nothing but ``split_points`` and a loss. Under GPipe, 1F1B
(also recomputing) and 2BW they reproduce a one-process reference that runs the unsplit
model on the same micro-batches (2BW: the delayed-gradient rule ``W(t+1) = W(t) - lr *
grad f(W(t-1))``) to 1e-5, and the tied copies on the first and the last stage stay equal
bit for bit. With 2 replicas of each stage (4 ranks) the same holds, the REDUCE averaging
before the tied sum. ``eval_step`` and ``predict`` run the traced stages forward only.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from syncline import comm
from syncline.errors import ConfigError
from syncline.pipeline import Pipeline
from syncline.testing import run_ranks

transformers = pytest.importorskip("transformers")

STEPS, BATCH, M, SEQ = 4, 8, 4, 8
LR, MOMENTUM = 0.1, 0.9
TIED = ("transformer.wte.weight", "lm_head.weight")


def gpt2() -> torch.nn.Module:
    cfg = transformers.GPT2Config(
        n_layer=4, n_embd=32, n_head=2, vocab_size=100, n_positions=16, use_cache=False,
        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def resnet() -> torch.nn.Module:
    cfg = transformers.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=10
    )
    torch.manual_seed(0)
    return transformers.ResNetForImageClassification(cfg)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def lm_batches() -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS + 1):
        ids = torch.randint(0, 100, (BATCH, SEQ), generator=g)
        mask = torch.ones(BATCH, SEQ, dtype=torch.long)
        mask[::3, -3:] = 0  # padded rows, in every micro-batch of 2
        out.append(({"input_ids": ids, "attention_mask": mask}, ids.masked_fill(mask == 0, -100)))
    return out


def image_batches() -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    return [
        ({"pixel_values": torch.randn(BATCH, 3, 16, 16, generator=g)},
         torch.randint(0, 10, (BATCH,), generator=g))
        for _ in range(STEPS + 1)
    ]  # fmt: skip


MODELS: dict[str, tuple[Callable[[], torch.nn.Module], list[str], Callable, Callable]] = {
    "gpt2": (gpt2, ["transformer.h.2"], lm_loss, lm_batches),
    "resnet": (resnet, ["resnet.encoder.stages.1"], F.cross_entropy, image_batches),
}
CASES = {  # name -> (model, schedule, recompute)
    "gpt2-gpipe": ("gpt2", "gpipe", False),
    "gpt2-1f1b": ("gpt2", "1f1b", False),
    "gpt2-1f1b-recompute": ("gpt2", "1f1b", True),
    "gpt2-2bw": ("gpt2", "2bw", False),
    "resnet-gpipe": ("resnet", "gpipe", False),
    "resnet-1f1b": ("resnet", "1f1b", False),
    "resnet-2bw": ("resnet", "2bw", False),
}


def _optimizer(params):
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def _logits(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.logits


def reference(
    model_name: str, schedule: str, parts: int, build: Callable | None = None
) -> tuple[torch.nn.Module, list[float]]:
    """The unsplit model trained in one process on the same ``parts`` micro-batches per batch
    (each loss divided by ``parts``, as the pipeline's); 2BW: the gradient taken on the
    weights one step behind (and not for the batch a flush started on the newest)."""
    default, _, loss_fn, batches = MODELS[model_name]
    model = (build or default)()
    behind = copy.deepcopy(model)
    opt = _optimizer(model.parameters())
    losses = []
    for step, (inputs, target) in enumerate(batches()):
        where = behind if schedule == "2bw" and step > 0 else model
        where.zero_grad()
        total = 0.0
        size = BATCH // parts
        for i in range(parts):
            rows = slice(i * size, (i + 1) * size)
            out = where(**{k: v[rows] for k, v in inputs.items()})
            loss = loss_fn(_logits(out), target[rows])
            (loss / parts).backward()
            total += loss.item() / parts
        losses.append(total)
        newest = copy.deepcopy(model.state_dict())
        for p, q in zip(model.parameters(), where.parameters(), strict=True):
            p.grad = q.grad.clone()
        opt.step()
        behind.load_state_dict(newest)
    return model, losses


def _run(pipe: Pipeline, batches, schedule: str) -> list[float]:
    it = iter(batches)
    losses = [pipe.train_step(it) for _ in range(STEPS)]
    losses.append(pipe.flush() if schedule == "2bw" else pipe.train_step(it))
    return losses


def _train_rank(rank: int, world: int) -> dict[str, dict]:
    out = {}
    for name, (model_name, schedule, recompute) in CASES.items():
        build, points, loss_fn, batches = MODELS[model_name]
        pipe = Pipeline(
            build(), num_stages=2, num_microbatches=M, schedule=schedule, loss_fn=loss_fn,
            optimizer=_optimizer, recompute=recompute, split_points=points, timeout_s=60,
        )  # fmt: skip
        result = {"losses": _run(pipe, batches(), schedule), "state": pipe.local_state_dict()}
        if name == "gpt2-1f1b":
            inputs, labels = lm_batches()[0]
            result["eval"] = pipe.eval_step(iter([(inputs, labels)]))
            result["predict"] = pipe.predict(inputs)
        out[name] = result
    return out


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_ranks(_train_rank, 2, timeout_s=240)


@pytest.mark.parametrize("name", list(CASES))
def test_traced_pipelines_match_one_process(two_ranks, name) -> None:
    model_name, schedule, _ = CASES[name]
    want, want_losses = reference(model_name, schedule, M)
    state = {**two_ranks[0][name]["state"], **two_ranks[1][name]["state"]}
    expected = want.state_dict()
    assert set(state) == set(expected)
    buffers = {n for n, _ in want.named_buffers()}
    for key, value in expected.items():
        if schedule == "2bw" and key in buffers:
            continue  # the stale reference resets running statistics to the newest model's
        torch.testing.assert_close(state[key], value, atol=1e-5, rtol=0, msg=f"{name} {key}")
    for r in two_ranks:
        assert r[name]["losses"] == pytest.approx(want_losses, abs=1e-5), name
    start = MODELS[model_name][0]().state_dict()
    moved = [k for k in expected if k not in buffers and not torch.equal(start[k], expected[k])]
    assert len(moved) > len(expected) // 2  # it trained
    if model_name == "gpt2":  # each copy on its stage, equal bit for bit
        assert TIED[0] in two_ranks[0][name]["state"] and TIED[1] in two_ranks[1][name]["state"]
        assert torch.equal(state[TIED[0]], state[TIED[1]])


def test_forward_only_on_traced_stages(two_ranks) -> None:
    want, _ = reference("gpt2", "1f1b", M)
    want.eval()
    inputs, labels = lm_batches()[0]
    with torch.no_grad():
        logits = want(**inputs).logits
        size = BATCH // M
        loss = sum(
            lm_loss(logits[i * size : (i + 1) * size], labels[i * size : (i + 1) * size]).item()
            for i in range(M)
        )
    for r in two_ranks:
        assert r["gpt2-1f1b"]["eval"] == pytest.approx(loss / M, abs=1e-5)
        torch.testing.assert_close(r["gpt2-1f1b"]["predict"], logits, atol=1e-5, rtol=0)


def _replica_rank(rank: int, world: int) -> dict:
    pipe_group, dp_group = comm.build_pipeline_groups(num_stages=2)
    replica, width = comm.group_rank(dp_group), comm.group_size(dp_group)
    pipe = Pipeline(
        gpt2(), num_stages=2, num_microbatches=M // width, schedule="2bw", loss_fn=lm_loss,
        optimizer=_optimizer, split_points=["transformer.h.2"], timeout_s=60,
        process_group=pipe_group, data_parallel_group=dp_group,
    )  # fmt: skip
    n = BATCH // width
    shard = [
        ({k: v[replica * n : (replica + 1) * n] for k, v in x.items()}, y[replica * n : (replica + 1) * n])
        for x, y in lm_batches()
    ]  # fmt: skip
    return {"losses": _run(pipe, shard, "2bw"), "state": pipe.local_state_dict()}


@pytest.mark.slow  # 4 ranks each importing transformers; replicas: test_pipeline_replicas
def test_traced_pipeline_with_replicas_matches_and_keeps_tied_copies_equal() -> None:
    per_rank = run_ranks(_replica_rank, 4, timeout_s=240)
    want, want_losses = reference("gpt2", "2bw", M)
    # rank = stage * width + replica: ranks 0, 1 hold stage 0; ranks 2, 3 stage 1
    for replica in range(2):
        state = {**per_rank[replica]["state"], **per_rank[2 + replica]["state"]}
        for key, value in want.state_dict().items():
            torch.testing.assert_close(state[key], value, atol=1e-5, rtol=0, msg=key)
        assert torch.equal(state[TIED[0]], state[TIED[1]])
    assert torch.equal(per_rank[0]["state"][TIED[0]], per_rank[3]["state"][TIED[1]])
    for r in per_rank:
        assert r["losses"] == pytest.approx(want_losses, abs=1e-5)


def meta_gpt2() -> torch.nn.Module:
    """The test's GPT-2 built on the meta device: shapes only, no memory."""
    with torch.device("meta"):
        return gpt2()


def hf_init(model: torch.nn.Module) -> Callable[[str, torch.nn.Module], None]:
    """HuggingFace's own initialiser, module by module (GPT-2's scaled projections too)."""
    return lambda _, module: model._init_weights(module)


def materialized_gpt2() -> torch.nn.Module:
    """What a meta-built pipeline of any split starts from, in one process."""
    from syncline.models.meta_modules import materialize_modules

    model = meta_gpt2()
    return materialize_modules(model, seed=7, init=hf_init(model))


def _meta_rank(rank: int, world: int) -> dict:
    model = meta_gpt2()
    pipe = Pipeline(
        model, num_stages=2, num_microbatches=M, schedule="2bw", loss_fn=lm_loss,
        optimizer=_optimizer, split_points=["transformer.h.2"], timeout_s=60,
        init=hf_init(model), seed=7,
    )  # fmt: skip
    losses = _run(pipe, lm_batches(), "2bw")
    return {
        "losses": losses,
        "state": pipe.local_state_dict(),
        "model_still_meta": all(t.is_meta for t in [*model.parameters(), *model.buffers()]),
    }


def test_a_meta_built_gpt2_materialises_only_each_ranks_stage_and_matches() -> None:
    """Stage-only materialisation of a model split at named modules: each rank allocates
    only its stage's modules (the model it was given stays on the meta device), seeded by
    module name, and training matches the one-process materialised model under 2BW."""
    per_rank = run_ranks(_meta_rank, 2, timeout_s=240)
    assert all(r["model_still_meta"] for r in per_rank)
    first, last = (set(r["state"]) for r in per_rank)
    assert not any(
        k.startswith("transformer.h.2") or k.startswith("transformer.h.3") for k in first
    )
    assert not any(k.startswith("transformer.h.0") or k.startswith("transformer.h.1") for k in last)
    want, want_losses = reference("gpt2", "2bw", M, build=materialized_gpt2)
    state = {**per_rank[0]["state"], **per_rank[1]["state"]}
    for key, value in want.state_dict().items():
        torch.testing.assert_close(state[key], value, atol=1e-5, rtol=0, msg=key)
    assert torch.equal(state[TIED[0]], state[TIED[1]])
    for r in per_rank:
        assert r["losses"] == pytest.approx(want_losses, abs=1e-5)


def test_bad_split_points_are_refused_before_any_work() -> None:
    def make(**kw):
        args = {"num_stages": 2, "num_microbatches": 2, "loss_fn": lm_loss,
                "optimizer": _optimizer, "split_points": ["transformer.h.2"]}  # fmt: skip
        return Pipeline(gpt2(), **{**args, **kw})

    with pytest.raises(ConfigError, match=r"num_stages=3 but split_points"):
        make(num_stages=3)
    with pytest.raises(ConfigError, match=r"\['transformer.h.9'\]"):
        make(split_points=["transformer.h.9"])
    with pytest.raises(ConfigError, match=r"balance=\[2, 2\] with split_points"):
        make(balance=[2, 2])
    with pytest.raises(ConfigError, match=r"nn.Sequential of layers, or any model"):
        Pipeline(gpt2(), num_stages=2, num_microbatches=2, loss_fn=lm_loss, optimizer=_optimizer)


@pytest.mark.slow  # the example as the README runs it: under torchrun
def test_the_readme_example_trains_a_tied_gpt2_under_torchrun(tmp_path) -> None:
    """``examples/pipeline_hf_gpt2.py``, as the README runs it (torchrun, 2 ranks)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "examples" / "pipeline_hf_gpt2.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", str(script),
           "--steps", "6", "--schedule", "1f1b"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=tmp_path,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    said = [line for line in done.stderr.splitlines() if "Warning" not in line]
    # KNOWN, OPEN: in about 1 run in 10 on this 2-core machine a rank aborts while the
    # process exits, after the run has finished and printed its result ("terminate called
    # without an active exception": a C++ thread still joinable at interpreter teardown).
    # Only that exact teardown abort, after the last line, is let through; any other
    # failure, or that abort before the result, fails the test.
    teardown_abort = (
        "terminate called without an active exception" in done.stderr
        and "exitcode  : -6" in done.stderr
        and "tied embedding and head equal" in done.stdout
    )
    assert done.returncode == 0 or teardown_abort, "\n".join(said)[-4000:]
    losses = [float(line.split()[-1]) for line in done.stdout.splitlines() if "loss" in line]
    assert len(losses) == 2 and losses[1] < losses[0]
    assert "tied embedding and head equal on the first and last stage: True" in done.stdout
