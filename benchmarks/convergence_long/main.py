"""Long-run convergence: syncline's compressors against DDP and DDP's PowerSGD hook, by loss.

Every configuration trains the same byte-level GPT from the same initialisation on the same
batches (2 ranks, loopback gloo, SGD with momentum, constant learning rate); only the
data-parallel engine and its compression differ. Loss per step does not depend on timing, so
no network is emulated and configurations run one after the other. Configurations:

    ddp                 torch DDP, SGD momentum M
    hook:R[:SEED]       torch DDP + ``powerSGD_hook`` at rank R (its defaults otherwise;
                        ``start_powerSGD_iter`` = ``--warmup`` clamped to DDP's minimum 2;
                        SEED its ``random_seed``, 0 by default)
    none, powersgd:R, csc:D[:...], ...   syncline.DataParallel with that compression spec
                        (a compressor that owns the momentum gets SGD without it)

Per configuration it records every step's training loss (mean over ranks), the norm of the
update direction each step applied (the reduced gradient: a burst of accumulated residual
shows as a spike), and the held-out loss every ``--eval-every`` steps on fixed held-out
batches. A run is stopped early once its loss is not finite (recorded as such).

    python -m benchmarks.convergence_long --configs ddp,csc:0.01 --steps 300 --lr 0.1
    python -m benchmarks.convergence_long --configs hook:4,powersgd:4 --steps 500

Results are merged into ``--out`` (default ``benchmarks/results/convergence_long.json``) under
``--name`` (default: built from the model shape and learning rate), one section per run.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path
from typing import Any

import torch

from syncline.testing import run_ranks
from syncline.testing.bench import merge_results, read_results

WORLD = 2
RESULTS = Path(__file__).resolve().parents[1] / "results" / "convergence_long.json"


def _engine(name: str, model: torch.nn.Module, s: dict[str, Any]) -> tuple[Any, bool]:
    """(wrapped model, whether the optimizer keeps its momentum) for configuration ``name``."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from syncline import DataParallel
    from syncline.dp import build_compressor
    from syncline.dp.registry import COMPRESSORS, compressor_name

    if name == "ddp" or name.startswith("hook:"):
        ddp = DDP(model, bucket_cap_mb=s["bucket_cap_mb"])
        if name.startswith("hook:"):
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

            _, rank, *seed = name.split(":")  # hook:R or hook:R:SEED (its random_seed)
            state = psgd.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=int(rank),
                start_powerSGD_iter=max(2, s["warmup"]),
                random_seed=int(seed[0]) if seed else 0,
            )
            ddp.register_comm_hook(state, psgd.powerSGD_hook)
        return ddp, True
    comp = build_compressor(name)
    owns = COMPRESSORS.get(compressor_name(name)).owns_momentum
    cap = s["bucket_cap_mb"]
    return DataParallel(model, compression=comp, bucket_cap_mb=cap), not owns


def _train(rank: int, world: int, s: dict[str, Any], name: str) -> dict[str, Any]:
    from syncline.data import ByteDataset, ShardedBatches, stdlib_corpus
    from syncline.models import build_model, lm_loss

    data = ByteDataset(stdlib_corpus(s["corpus_bytes"]), s["block_size"])
    train, val = data.split(0.05)
    torch.manual_seed(s["seed"])
    shape = {k: s[k] for k in ("n_layer", "n_embd", "n_head", "block_size")}
    model = build_model("gpt", **shape)
    engine, keeps_momentum = _engine(name, model, s)
    momentum = s["momentum"] if keeps_momentum else 0.0
    opt = torch.optim.SGD(engine.parameters(), lr=s["lr"], momentum=momentum)
    batches = ShardedBatches(train, s["global_batch"], rank, world, s["seed"])
    held = ShardedBatches(val, s["global_batch"], rank, world, s["seed"] + 1)
    losses: list[float] = []
    update_norms: list[float] = []
    evals: list[tuple[int, float]] = []
    t0 = time.perf_counter()

    def evaluate(step: int) -> None:
        model.eval()
        with torch.no_grad():
            vals = [
                lm_loss(model(x), y).item() for x, y in map(held.batch, range(s["eval_batches"]))
            ]
        model.train()
        evals.append((step, sum(vals) / len(vals)))

    for step in range(s["steps"]):
        if s["eval_every"] and step % s["eval_every"] == 0:
            evaluate(step)
        x, y = batches.batch(step)
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(engine(x), y)
        loss.backward()
        norm = torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None])
        update_norms.append(float(norm.norm()))
        opt.step()
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            break
    if s["eval_every"] and math.isfinite(losses[-1]):
        evaluate(len(losses))
    return {
        "losses": losses,
        "update_norms": update_norms,
        "evals": evals,
        "seconds": time.perf_counter() - t0,
        "optimizer_momentum": momentum,
        "engine": repr(getattr(engine, "compression", None) or type(engine).__name__),
    }


def summarise(ranks: list[dict[str, Any]], s: dict[str, Any]) -> dict[str, Any]:
    """Mean over ranks per step, the smoothed loss at checkpoints, and the first non-finite."""
    n = min(len(r["losses"]) for r in ranks)
    curve = [sum(r["losses"][i] for r in ranks) / len(ranks) for i in range(n)]
    window = s["smooth"]
    marks = sorted({m for m in (50, 100, 200, 300, 500, 750, 1000, 1500, 2000) if m <= n} | {n})
    at = {str(m): sum(curve[m - window : m]) / window for m in marks if m >= window}
    finite = all(math.isfinite(v) for v in curve)
    evals = [
        (step, sum(r["evals"][i][1] for r in ranks) / len(ranks))
        for i, (step, _) in enumerate(ranks[0]["evals"])
    ]
    return {
        "steps_run": n,
        "finite": finite,
        "first_non_finite_step": None
        if finite
        else next(i for i, v in enumerate(curve) if not math.isfinite(v)),
        "smoothed_loss_at": at,
        "final_loss": at.get(str(n)),
        "held_out": evals,
        "update_norm_max": max(ranks[0]["update_norms"][:n]),
        "update_norm_median": sorted(ranks[0]["update_norms"][:n])[n // 2],
        "curve": [round(v, 5) for v in curve],
        "update_norms": [round(v, 5) for v in ranks[0]["update_norms"][:n]],
        "seconds": ranks[0]["seconds"],
        "optimizer_momentum": ranks[0]["optimizer_momentum"],
        "engine": ranks[0]["engine"],
    }


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.convergence_long")
    ap.add_argument("--configs", default="ddp,hook:4,powersgd:4,csc:0.01")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--warmup", type=int, default=2, help="the PowerSGD hook's start iteration")
    ap.add_argument("--bucket-cap-mb", type=float, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smooth", type=int, default=20, help="loss window at each mark, in steps")
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-batches", type=int, default=4)
    ap.add_argument("--corpus-bytes", type=int, default=4_000_000)
    ap.add_argument("--name", default="")
    ap.add_argument("--timeout", type=float, default=7200.0)
    ap.add_argument("--out", default=str(RESULTS))
    return ap


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    s = {k: v for k, v in vars(a).items() if k not in ("configs", "name", "out", "timeout")}
    if s["bucket_cap_mb"] is None:
        s["bucket_cap_mb"] = 25.0  # DDP's default, and DataParallel's with a stateful compressor
    name = a.name or f"gpt{a.n_layer}x{a.n_embd}_lr{a.lr:g}_b{a.global_batch}"
    old = read_results(Path(a.out)).get(name, {})
    configs: dict[str, Any] = old.get("configs", {}) if old.get("settings") == s else {}
    for config in (c for c in a.configs.split(",") if c):
        ranks = run_ranks(_train, WORLD, s, config, timeout_s=a.timeout, comm_timeout_s=600.0)
        configs[config] = res = summarise(ranks, s)
        marks = " ".join(f"{k}:{v:.3f}" for k, v in res["smoothed_loss_at"].items())
        print(f"[{name}] {config}: {marks}  finite={res['finite']} "
              f"update max {res['update_norm_max']:.3g} median {res['update_norm_median']:.3g} "
              f"({res['seconds']:.0f} s)", flush=True)  # fmt: skip
        merge_results(Path(a.out), "convergence_long", {name: {"settings": s, "configs": configs}})
    return 0
