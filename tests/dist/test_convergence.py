"""Compressed data parallelism converges like uncompressed: a small GPT on real stdlib text.

Two gloo ranks train the same GPT from the same initialisation on the same batches for the same
number of steps, once per compressor, inside one pair of processes (one spawn for the whole
module), with **SGD with heavy-ball momentum 0.9** for every configuration: the optimizer's
own momentum for none/fp16/bf16/PowerSGD, and for CSC the same momentum moved *inside* the
compressor (momentum correction; the optimizer then runs with momentum 0), as
:func:`syncline.train.trainer.make_optimizer` does. The final loss (mean over both ranks of the
last ``TAIL`` steps) must be within 1 % of uncompressed for fp16/bf16 and within 5 % for CSC
(1 % density) and PowerSGD.

Setting: 2-layer GPT (n_embd 32, 42,880 parameters; one bucket, CSC three), 300 steps, global batch 32,
peak lr 0.05 with cosine decay to 5 %. Gaps of the final loss against uncompressed, measured
on 2 cores (seeds 0 / 1 / 2; rerun with ``python -m tests.dist.test_convergence 0 1 2``):

==============================================  ===========================
fp16, bf16                                       +0.00 % / +0.00 % / +0.00 %
PowerSGD rank 4 per tensor, 10 dense steps       +0.39 % / +0.45 % / +0.44 %
CSC 1 %, chunk 16, exp ramp over 50 steps        +2.11 % / +4.02 % / +4.13 %
  (one bucket, before the per-bucket budget)
CSC as above, 3 buckets (0.04 MiB caps), the     +0.58 % / +2.83 %
  density carried per bucket (issue 15)
==============================================  ===========================

* CSC: ``chunk_elems=16`` -> 2,680 chunks, 27 sent per step (1 %). Its warm-up matters a lot,
  and the margin to 5 % is thin: with a *dense* warm-up of 20 or 50 steps the gap was +8.6 %
  and +8.4 % (seed 0); dense 100 steps: +3.0 / +4.2 / +1.7 %; 600 steps with 50 dense: +5.2 %
  (seed 0); 400 steps with 80 dense: +5.4 % (seed 2). DGC's exponential ramp
  (``ramp="exp"``: density ``0.01 ** (step / 50)``) reaches the dense-100 result with half the
  warm-up, most of it already sparse (density below 10 % from step 25).
* PowerSGD: rank 4 per weight matrix (DDP's rule: only matrices whose factors are >= 2x
  smaller; biases and norms go dense). The earlier whole-bucket PowerSGD was 22 % worse than
  uncompressed with momentum on the benchmark GPT.
* A momentum-free variant is not kept: it exercised neither CSC's momentum correction nor
  PowerSGD with momentum, and every code path it covered is covered here.
"""

from __future__ import annotations

import math
import time

import pytest
import torch

from syncline.testing import run_ranks

pytestmark = pytest.mark.slow  # 300 steps per compressor: the full tier only

WORLD = 2
SEED = 0
STEPS = 300
TAIL = 50  # final loss = mean of the last TAIL steps (both ranks)
GLOBAL_BATCH = 32
LR = 0.05  # peak; with momentum 0.9 the step is about that of lr 0.5 without momentum
MOMENTUM = 0.9
MODEL = {"n_layer": 2, "n_embd": 32, "n_head": 2, "block_size": 32}  # 42,880 parameters
CORPUS_BYTES = 1_000_000
CSC_CHUNK = 16  # 2,680 chunks, 27 sent per step at 1 %
CSC_WARMUP = 50  # DGC's exponential ramp: density 0.01 ** (step / 50) before step 50
CSC_BUCKET_MB = 0.04  # 3 buckets (caps of ~10,500 elements, whole tensors): several budgets
PSGD_RANK = 4
PSGD_WARMUP = 10
CONFIGS = ("none", "fp16", "bf16", "csc", "powersgd")
HALF_TOL = 0.01
COMPRESSED_TOL = 0.05


def _compressor(name: str):
    from syncline.dp.compression import NoCompression
    from syncline.dp.compressors import BF16, CSC, FP16, PowerSGD

    return {
        "none": NoCompression,
        "fp16": FP16,
        "bf16": BF16,
        "csc": lambda: CSC(
            0.01, chunk_elems=CSC_CHUNK, warmup_steps=CSC_WARMUP, momentum=MOMENTUM, ramp="exp"
        ),
        "powersgd": lambda: PowerSGD(rank=PSGD_RANK, warmup_steps=PSGD_WARMUP),
    }[name]()


def _lr(step: int) -> float:
    return LR * (0.05 + 0.95 * 0.5 * (1.0 + math.cos(math.pi * step / STEPS)))


def _train_rank(rank: int, world: int, seed: int) -> dict[str, dict]:
    from syncline import DataParallel
    from syncline.data import ByteDataset, ShardedBatches, stdlib_corpus
    from syncline.models import build_model, lm_loss

    data = ByteDataset(stdlib_corpus(CORPUS_BYTES), MODEL["block_size"])
    out = {}
    for name in CONFIGS:
        torch.manual_seed(seed)
        model = build_model("gpt", **MODEL)
        # CSC in several buckets, so that its per-bucket chunk budget is exercised
        cap = CSC_BUCKET_MB if name == "csc" else None
        dp = DataParallel(
            model, compression=_compressor(name), bucket_cap_mb=cap, first_bucket_cap_mb=cap
        )
        momentum = 0.0 if name == "csc" else MOMENTUM  # CSC applies it itself
        opt = torch.optim.SGD(dp.parameters(), lr=LR, momentum=momentum)
        t0 = time.perf_counter()
        batches = ShardedBatches(data, GLOBAL_BATCH, rank, world, seed)
        losses = []
        for step in range(STEPS):
            for group in opt.param_groups:
                group["lr"] = _lr(step)
            x, y = batches.batch(step)
            opt.zero_grad(set_to_none=True)
            loss = lm_loss(dp(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        out[name] = {
            "losses": losses,
            "wire_bytes": dp.last_stats.wire_bytes,
            "dense_bytes": dp.last_stats.dense_bytes,
            "seconds": time.perf_counter() - t0,
            "buckets": len(dp.bucket_plan.buckets),
        }
    return out


def train_all(seed: int = SEED) -> dict[str, dict]:
    """Per configuration: rank-averaged loss curve, final loss, last step's wire bytes."""
    ranks = run_ranks(_train_rank, WORLD, seed, timeout_s=240.0)
    result = {}
    for name in CONFIGS:
        curve = [sum(r[name]["losses"][i] for r in ranks) / WORLD for i in range(STEPS)]
        result[name] = {
            "curve": curve,
            "final": sum(curve[-TAIL:]) / TAIL,
            "wire_bytes": ranks[0][name]["wire_bytes"],
            "dense_bytes": ranks[0][name]["dense_bytes"],
            "seconds": ranks[0][name]["seconds"],
            "buckets": ranks[0][name]["buckets"],
        }
    return result


@pytest.fixture(scope="module")
def trained() -> dict[str, dict]:
    return train_all(SEED)


def _gap(trained: dict[str, dict], name: str) -> float:
    return trained[name]["final"] / trained["none"]["final"] - 1.0


def test_uncompressed_training_learns(trained) -> None:
    curve = trained["none"]["curve"]
    assert math.isfinite(trained["none"]["final"])
    # from ln(256) = 5.5 to well below the unigram entropy of source code (~3.3 nats)
    assert trained["none"]["final"] < 2.8, trained["none"]["final"]
    assert trained["none"]["final"] < curve[0] - 2.0, curve[0]  # it starts near ln(256)


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_half_width_final_loss_within_1_percent(trained, name) -> None:
    gap = _gap(trained, name)
    assert abs(gap) <= HALF_TOL, f"{name}: final {trained[name]['final']:.4f} ({gap:+.2%})"


@pytest.mark.parametrize("name", ["csc", "powersgd"])
def test_compressed_final_loss_within_5_percent(trained, name) -> None:
    gap = _gap(trained, name)
    assert abs(gap) <= COMPRESSED_TOL, f"{name}: final {trained[name]['final']:.4f} ({gap:+.2%})"


# CSC: 27 chunks of 16 fp16 + 2,680 fp32 scores = 6.8 % of dense; PowerSGD: rank 4 of
# 32-wide matrices plus the dense biases and norms = 17.6 %
@pytest.mark.parametrize(("name", "most"), [("csc", 0.1), ("powersgd", 0.25)])
def test_compressed_runs_really_compressed(trained, name, most) -> None:
    """The last step went through the sparse / low-rank path, not a dense fallback."""
    t = trained[name]
    assert 0 < t["wire_bytes"] <= most * t["dense_bytes"], (t["wire_bytes"], t["dense_bytes"])
    if name == "csc":
        assert t["buckets"] >= 3  # the chunk budget is carried per bucket


if __name__ == "__main__":  # local robustness check: python -m tests.dist.test_convergence 0 1 2
    import sys

    for s in [int(a) for a in sys.argv[1:]] or [SEED]:
        res = train_all(s)
        gaps = ", ".join(
            f"{n} {_gap(res, n):+.2%} ({res[n]['wire_bytes'] / res[n]['dense_bytes']:.3f} wire)"
            for n in CONFIGS[1:]
        )
        gaps += "; s: " + " ".join(f"{res[n]['seconds']:.0f}" for n in CONFIGS)
        print(f"seed {s}: none final {res['none']['final']:.4f}; {gaps}", flush=True)
