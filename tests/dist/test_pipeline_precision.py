"""Mixed precision in pipelines: bf16 trains as a one-process autocast reference does, and an
fp16 overflow on one rank skips the same step on every stage and every replica.

The bf16 reference runs the same micro-batches in one process, each forward under autocast,
accumulating ``loss / m`` (2BW: the stale-weight rule), so the pipeline must reproduce it up to
the order fp32 sums are taken in; the fp32 run is further from it than that, so autocast was
really on.
"""

from __future__ import annotations

import copy

import pytest
import torch

from syncline.comm import build_pipeline_groups
from syncline.compression import CSC, PowerSGD
from syncline.dp.compression import Compressor
from syncline.dp.precision import autocast
from syncline.errors import ConfigError
from syncline.models import lm_loss
from syncline.pipeline import Pipeline
from syncline.testing import run_ranks
from tests.zoo.models import LM_STEPS, lm_batches, tiny_gpt
from tests.zoo.schedules import optimizer

M = 4
SCHEDULES = ("gpipe", "1f1b", "2bw")


def _bf16_rank(rank: int, world: int) -> dict[str, dict]:
    out = {}
    for schedule in SCHEDULES:
        pipe = Pipeline(
            tiny_gpt(), num_stages=2, num_microbatches=M, schedule=schedule, loss_fn=lm_loss,
            optimizer=optimizer("sgd"), balance=[2, 2], timeout_s=60, precision="bf16",
        )  # fmt: skip
        batches = iter(lm_batches())
        losses = [pipe.train_step(batches) for _ in range(LM_STEPS - 1)]
        losses.append(pipe.flush() if schedule == "2bw" else pipe.train_step(batches))
        out[schedule] = {"state": pipe.local_state_dict(), "losses": losses}
    return out


def _microbatched_reference(precision: str, *, stale: bool) -> tuple[dict, list[float]]:
    """``tiny_gpt`` in one process: each batch cut into M micro-batches, each forward under
    ``precision``'s autocast, ``loss / M`` backpropagated (2BW: on the weights one step
    behind), then one SGD step."""
    model = tiny_gpt()
    opt = optimizer("sgd")(model.parameters())
    behind = copy.deepcopy(model)
    losses = []
    for x, y in lm_batches():
        where = behind if stale else model
        where.zero_grad()
        total = 0.0
        for xs, ys in zip(x.chunk(M), y.chunk(M), strict=True):
            with autocast(precision, torch.device("cpu")):
                loss = lm_loss(where(xs), ys)
            (loss / M).backward()
            total += loss.item()
        losses.append(total / M)
        newest = copy.deepcopy(model.state_dict())
        for p, q in zip(model.parameters(), where.parameters(), strict=True):
            p.grad = q.grad.clone()
        opt.step()
        behind.load_state_dict(newest)
    return model.state_dict(), losses


@pytest.fixture(scope="module")
def bf16_runs() -> list[dict]:
    return run_ranks(_bf16_rank, 2, timeout_s=150)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_bf16_pipeline_matches_the_one_process_autocast_reference(bf16_runs, schedule) -> None:
    want, want_losses = _microbatched_reference("bf16", stale=schedule == "2bw")
    fp32, _ = _microbatched_reference("fp32", stale=schedule == "2bw")
    got = {}
    for r in bf16_runs:
        got.update(r[schedule]["state"])
    assert set(got) == set(want)
    key = "1.attn.c_attn.weight"
    gap_fp32 = (fp32[key] - want[key]).abs().max().item()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, atol=1e-4, rtol=0, msg=f"{schedule} {name}")
    assert (got[key] - want[key]).abs().max().item() < gap_fp32 / 4  # autocast was on
    for r in bf16_runs:
        assert r[schedule]["losses"] == pytest.approx(want_losses, abs=1e-3)


INJECT = 2  # the batch whose gradient overflows on one rank


def _compressor(name: str | None) -> Compressor | None:
    """An error-feedback compressor that keeps a residual on the tiny GPT's small tensors."""
    if name == "csc":
        return CSC(0.1, chunk_elems=64)
    if name == "powersgd":
        return PowerSGD(rank=1)
    assert name is None
    return None


def _fp16_rank(
    rank: int, world: int, schedule: str, inject_rank: int, compression: str | None = None
) -> dict:
    replicas = world // 2  # 2 pipeline ranks; interleaved: 2 stages on each
    stages, balance = (4, [1, 1, 1, 1]) if schedule == "interleaved" else (2, [2, 2])
    groups = build_pipeline_groups(2, timeout_s=60) if replicas > 1 else (None, None)
    pipe = Pipeline(
        tiny_gpt(), num_stages=stages, num_microbatches=M, schedule=schedule, loss_fn=lm_loss,
        optimizer=optimizer("sgd"), balance=balance, timeout_s=60, precision="fp16",
        process_group=groups[0], data_parallel_group=groups[1],
        compression=_compressor(compression),
    )  # fmt: skip
    assert pipe.loss_scaler is not None
    pipe.loss_scaler.value = 1024.0
    forwards = {"n": 0}

    def poison(module: torch.nn.Module, args: object, output: torch.Tensor) -> None:
        """Batch INJECT's micro-batches (forwards run batch by batch, M each) get an inf
        gradient on this rank's first layer output."""
        if rank == inject_rank and forwards["n"] // M == INJECT and output.requires_grad:
            output.register_hook(lambda g: torch.full_like(g, float("inf")))
        forwards["n"] += 1

    pipe.stage_module[0].register_forward_hook(poison)
    batches = iter(lm_batches())
    record = []
    for _ in range(LM_STEPS - 1):
        before = {k: v.clone() for k, v in pipe.local_state_dict().items()}
        pipe.train_step(batches)
        after = pipe.local_state_dict()
        record.append(
            {
                "changed": any(not torch.equal(before[k], after[k]) for k in before),
                "scale": pipe.loss_scaler.value,
                "finite": all(bool(torch.isfinite(v).all()) for v in after.values()),
            }
        )
    pipe.flush()
    residual = [t for b in pipe.compression.state_dict().get("buckets", {}).values()
                for t in b.values()]  # fmt: skip
    return {
        "record": record,
        "skipped": pipe.loss_scaler.skipped,
        "state": pipe.local_state_dict(),
        "residual_finite": all(bool(torch.isfinite(t).all()) for t in residual),
        "residual_tensors": len(residual),
    }


@pytest.mark.parametrize(
    ("schedule", "world", "inject_rank", "compression"),
    [
        ("1f1b", 2, 1, None),
        ("2bw", 2, 0, None),
        ("gpipe", 4, 3, None),
        ("2bw", 4, 1, None),
        ("1f1b", 4, 2, "csc"),
        ("2bw", 4, 0, "csc"),
        ("gpipe", 4, 1, "powersgd"),
        ("interleaved", 4, 3, "csc"),
    ],
    ids=["1f1b-2ranks", "2bw-2ranks", "gpipe-2x2", "2bw-2x2", "1f1b-2x2-csc", "2bw-2x2-csc",
         "gpipe-2x2-powersgd", "interleaved-2x2-csc"],
)  # fmt: skip
def test_fp16_overflow_on_one_rank_skips_the_same_step_everywhere(
    schedule: str, world: int, inject_rank: int, compression: str | None
) -> None:
    """An inf on one rank's gradient (one stage of one replica): every rank skips one step,
    halves the scale alike, keeps finite weights; replicas stay bit-identical. With an
    error-feedback REDUCE the compressor's residual stays finite on every rank too (the inf
    was zeroed before the compressor saw it)."""
    results = run_ranks(_fp16_rank, world, schedule, inject_rank, compression, timeout_s=150)
    for r in results:
        assert r["skipped"] == 1
        assert all(s["finite"] for s in r["record"])
        assert r["residual_finite"]
        assert (r["residual_tensors"] > 0) == (compression is not None)
    # the same calls change weights and move the scale on every rank
    assert len({tuple(s["changed"] for s in r["record"]) for r in results}) == 1
    assert len({tuple(s["scale"] for s in r["record"]) for r in results}) == 1
    scales = [s["scale"] for s in results[0]["record"]]
    assert 512.0 in scales and scales[0] == 1024.0
    if world == 4:  # global rank = stage * replicas + replica: 0,1 stage 0; 2,3 stage 1
        for a, b in ((0, 1), (2, 3)):
            for k, v in results[a]["state"].items():
                assert torch.equal(v, results[b]["state"][k]), k


def _residual_rank(rank: int, world: int, precision: str) -> dict:
    """2 stages x 2 replicas, 1F1B, CSC on the REDUCE: the losses and CSC's residuals."""
    groups = build_pipeline_groups(2, timeout_s=60)
    pipe = Pipeline(
        tiny_gpt(), num_stages=2, num_microbatches=M, schedule="1f1b", loss_fn=lm_loss,
        optimizer=optimizer("sgd"), balance=[2, 2], timeout_s=60, precision=precision,
        process_group=groups[0], data_parallel_group=groups[1],
        compression=CSC(0.1, chunk_elems=64),
    )  # fmt: skip
    if pipe.loss_scaler is not None:
        pipe.loss_scaler.value = 2.0**14  # far from 1: a residual kept scaled would show
    batches = iter(lm_batches())
    losses = [pipe.train_step(batches) for _ in range(LM_STEPS)]
    buckets = pipe.compression.state_dict()["buckets"]
    return {
        "losses": losses,
        "residual": {f"{i}.{k}": t.norm().item() for i, b in buckets.items() for k, t in b.items()},
        "skipped": 0 if pipe.loss_scaler is None else pipe.loss_scaler.skipped,
    }


def test_fp16_with_an_error_feedback_reduce_keeps_its_residual_at_true_scale() -> None:
    """fp16 with CSC on the REDUCE: CSC gets each bucket unscaled, so its momentum and
    residual match the fp32 run's to autocast's precision (kept at the loss scale, 2**14,
    they would be 16384x as large), and the losses follow fp32's to 1 %."""
    fp32 = run_ranks(_residual_rank, 4, "fp32", timeout_s=150)
    fp16 = run_ranks(_residual_rank, 4, "fp16", timeout_s=150)
    for want, got in zip(fp32, fp16, strict=True):
        assert got["skipped"] == 0
        assert set(got["residual"]) == set(want["residual"]) and want["residual"]
        for key, norm in want["residual"].items():
            assert got["residual"][key] == pytest.approx(norm, rel=0.05, abs=1e-6), key
        assert got["losses"] == pytest.approx(want["losses"], rel=0.01)
    assert max(fp32[0]["residual"].values()) > 1e-3  # CSC kept something back


def test_an_unknown_precision_is_refused_before_any_work() -> None:
    with pytest.raises(ConfigError, match="precision='fp8' is invalid; valid: fp32, bf16, fp16"):
        Pipeline(
            tiny_gpt(), num_stages=2, num_microbatches=2, loss_fn=lm_loss,
            optimizer=optimizer("sgd"), precision="fp8",
        )  # fmt: skip
