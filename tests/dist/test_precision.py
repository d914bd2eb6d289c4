"""Mixed precision: fp16 loss scaling skips the same steps on every rank; bf16 trains as fp32."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from syncline import DataParallel
from syncline.compression import CSC
from syncline.testing import run_ranks
from syncline.dp.precision import LossScaler, autocast
from tests.zoo.train import train

TINY = ["--n-layer", "2", "--n-embd", "32", "--seq-len", "16", "--batch-size", "16"]


def _scaled_rank(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    dp = DataParallel(model, bucket_cap_mb=25)
    opt = torch.optim.SGD(dp.parameters(), lr=0.1)
    scaler = LossScaler(init_scale=1024.0)
    params = list(model.parameters())
    record = []
    for step in range(5):
        gen = torch.Generator().manual_seed(10 * step + rank)
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 2, generator=gen)
        before = [p.detach().clone() for p in params]
        opt.zero_grad()
        with autocast("fp16", torch.device("cpu")):
            loss = F.mse_loss(dp(x), y)
        scaler.scale(loss).backward()
        if step == 2 and rank == 1:  # an overflow only this rank sees (as behind a sparse wire)
            params[0].grad[0, 0] = float("inf")
        stepped = scaler.unscale_or_skip(params, step)
        if stepped:
            opt.step()
        record.append(
            {
                "stepped": stepped,
                "scale": scaler.value,
                "unchanged": all(torch.equal(a, p) for a, p in zip(before, params, strict=True)),
            }
        )
    return {"record": record, "weights": [p.detach().clone() for p in params]}


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank() -> None:
    results = run_ranks(_scaled_rank, 2, timeout_s=60)
    for r in results:
        assert [s["stepped"] for s in r["record"]] == [True, True, False, True, True]
        assert [s["scale"] for s in r["record"]] == [1024.0, 1024.0, 512.0, 512.0, 512.0]
        assert r["record"][2]["unchanged"] and not r["record"][3]["unchanged"]
    for a, b in zip(results[0]["weights"], results[1]["weights"], strict=True):
        assert torch.equal(a, b)  # the replicas never diverged


def _scaled_csc_rank(rank: int, world: int) -> dict:
    """fp16 beside CSC: the engine unscales each bucket before CSC sees it, so an inf on one
    rank never reaches a residual, and every rank still skips that step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    csc = CSC(0.25, chunk_elems=8, momentum=0.0)
    dp = DataParallel(model, bucket_cap_mb=25, compression=csc)
    opt = torch.optim.SGD(dp.parameters(), lr=0.1)
    scaler = LossScaler(init_scale=1024.0)
    params = list(model.parameters())
    first = params[0]
    record = []
    for step in range(6):
        gen = torch.Generator().manual_seed(10 * step + rank)
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 2, generator=gen)
        hook = None
        if step == 3 and rank == 1:  # inside backward, before the bucket is reduced
            hook = first.register_hook(lambda g: torch.full_like(g, float("inf")))
        opt.zero_grad()
        dp.unscale_in_reduce(scaler.value)
        with autocast("fp16", torch.device("cpu")):
            loss = F.mse_loss(dp(x), y)
        scaler.scale(loss).backward()
        if hook is not None:
            hook.remove()
        before = [p.detach().clone() for p in params]
        local = dp.overflowed_in_reduce()
        stepped = scaler.unscale_or_skip(params, step, unscaled=True, overflowed=local)
        if stepped:
            opt.step()
        residual = csc.state_dict()["buckets"]
        record.append(
            {
                "stepped": stepped,
                "local": local,
                "scale": scaler.value,
                "unchanged": all(torch.equal(a, p) for a, p in zip(before, params, strict=True)),
                "residual_finite": all(
                    bool(torch.isfinite(t).all())
                    for b in residual.values()
                    for t in b.values()
                    if isinstance(t, torch.Tensor)
                ),
            }
        )
    return {"record": record, "weights": [p.detach().clone() for p in params]}


def test_fp16_beside_csc_keeps_residuals_finite_and_skips_together() -> None:
    results = run_ranks(_scaled_csc_rank, 2, timeout_s=60)
    for r in results:
        rec = r["record"]
        assert [s["stepped"] for s in rec] == [True, True, True, False, True, True]
        assert [s["scale"] for s in rec] == [1024.0] * 3 + [512.0] * 3
        assert rec[3]["unchanged"] and not rec[4]["unchanged"]
        assert all(s["residual_finite"] for s in rec)
    assert [s["local"] for s in results[1]["record"]] == [False] * 3 + [True] + [False] * 2
    assert not any(s["local"] for s in results[0]["record"])  # rank 0 saw no inf itself
    for a, b in zip(results[0]["weights"], results[1]["weights"], strict=True):
        assert torch.equal(a, b)


def test_fp16_with_csc_trains_like_fp32_through_the_cli(tmp_path) -> None:
    """``syncline train --precision fp16 --compression csc:...``: the same losses as fp32 to
    within 1 % (the residual holds true-scale values), no step skipped at this size."""
    final = {}
    for precision in ("fp32", "fp16"):
        run = tmp_path / precision
        args = [*TINY, "--steps", "30", "--precision", precision, "--run-dir", str(run)]
        train(*args, "--compression", "csc:0.1:warmup=5:momentum=0")
        summary = json.loads((run / "summary.json").read_text())
        assert summary["final_loss"] < summary["first_loss"] - 1.0
        final[precision] = summary["final_loss"]
    assert summary["skipped_steps"] == 0 and summary["loss_scale"] == 2.0**16
    assert abs(final["fp16"] / final["fp32"] - 1) < 0.01, final


def _final_val(run) -> float:
    return json.loads((run / "summary.json").read_text())["final_val_loss"]


@pytest.mark.slow  # 3 runs of 40 steps: a convergence comparison
def test_bf16_and_fp16_train_like_fp32(tmp_path) -> None:
    """The same run in fp32, bf16 (autocast) and fp16 (autocast, loss scaling): the held-out
    loss after 40 steps within 2 % of fp32's, and fp16's loss scale checkpointed."""
    common = [*TINY, "--steps", "40", "--eval-every", "100", "--checkpoint-every", "20"]
    val = {}
    for precision in ("fp32", "bf16", "fp16"):
        run = tmp_path / precision
        train(*common, "--precision", precision, "--run-dir", str(run))
        summary = json.loads((run / "summary.json").read_text())
        assert summary["precision"] == precision
        val[precision] = _final_val(run)
    assert val["fp32"] < 4.0  # it learnt (from ln 256 = 5.5)
    for precision in ("bf16", "fp16"):
        assert abs(val[precision] / val["fp32"] - 1) < 0.02, val
    from syncline.train.snapshots import SnapshotStore
    from syncline.train.state import read_meta

    store = SnapshotStore(tmp_path / "fp16" / "checkpoints", keep=2)
    snap = store.latest()
    assert snap is not None and read_meta(store, snap)["loss_scale"]["scale"] > 0
