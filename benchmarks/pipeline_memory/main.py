"""Peak memory per pipeline rank at depth 1, 2 and 4, with the model's share next to it.

Each rank is its own process (``syncline.testing.run_ranks``, gloo, one thread each). A GPT
of several hundred MiB is pipelined two ways:

- ``meta``: built under ``torch.device("meta")``; each rank materialises only its stage's
  layers (the default of ``syncline train --pipeline-stages``);
- ``eager``: every rank builds the whole model and keeps its stage (what syncline did
  before; the other layers are garbage once cut away, but the peak has seen them all).

Each rank trains 2 steps of 1F1B with AdamW, then reports its peak resident set size
(``ru_maxrss``), its stage's weight bytes, and the RSS of the same process just before the
model was built (torch and the process group loaded). "growth" = peak - baseline is what
the model cost that rank: weights, gradients, AdamW's two moments (~4x the stage's weights)
and activations. Reported per depth and per rank, with the growth over the stage's weight
bytes; the claim is that under ``meta`` the growth follows the stage, not the model.

    python -m benchmarks.pipeline_memory --out benchmarks/results/pipeline_memory.json
"""

from __future__ import annotations

import argparse
import resource
from pathlib import Path
from typing import Any

import torch

from syncline.models import GPTConfig, build_gpt, gpt_layer_init, lm_loss
from syncline.pipeline import Pipeline
from syncline.testing import run_ranks
from syncline.testing.bench import write_json

MIB = 2**20


def _rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _rank(rank: int, world: int, how: str, cfg: GPTConfig, batch: int) -> dict[str, Any]:
    baseline = _rss()
    if how == "meta":
        with torch.device("meta"):
            model = build_gpt(cfg)
    else:
        torch.manual_seed(0)
        model = build_gpt(cfg)
    layers = len(model)
    even = [layers // world + (i < layers % world) for i in range(world)]
    pipe = Pipeline(
        model,
        num_stages=world,
        num_microbatches=2 * world,
        schedule="1f1b",
        loss_fn=lm_loss,
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4),
        balance=even,
        init=gpt_layer_init(cfg),
        timeout_s=600,
    )
    del model
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g)
    for _ in range(2):
        pipe.train_step(iter([(x, torch.roll(x, -1, dims=1))]))
    stage_bytes = sum(p.numel() * p.element_size() for p in pipe.stage_module.parameters())
    return {"peak_rss": _rss(), "baseline_rss": baseline, "stage_weight_bytes": stage_bytes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--embd", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--depths", default="1,2,4")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    cfg = GPTConfig(n_layer=args.layers, n_embd=args.embd, n_head=8, block_size=args.seq)
    with torch.device("meta"):
        model_bytes = sum(p.numel() * 4 for p in build_gpt(cfg).parameters())
    print(f"model: {model_bytes / MIB:.0f} MiB of fp32 weights", flush=True)
    rows = []
    for how in ("meta", "eager"):
        for depth in [int(d) for d in args.depths.split(",")]:
            per_rank = run_ranks(
                _rank, depth, how, cfg, args.batch, timeout_s=1800, start_method="spawn"
            )
            for rank, r in enumerate(per_rank):
                growth = r["peak_rss"] - r["baseline_rss"]
                row = {
                    "how": how,
                    "depth": depth,
                    "rank": rank,
                    "peak_rss_mib": round(r["peak_rss"] / MIB, 1),
                    "baseline_rss_mib": round(r["baseline_rss"] / MIB, 1),
                    "growth_mib": round(growth / MIB, 1),
                    "stage_weights_mib": round(r["stage_weight_bytes"] / MIB, 1),
                    "growth_over_stage_weights": round(growth / r["stage_weight_bytes"], 2),
                    "growth_over_model_weights": round(growth / model_bytes, 2),
                }
                rows.append(row)
                print(
                    f"{how:5s} depth {depth} rank {rank}: peak {row['peak_rss_mib']:7.1f} MiB "
                    f"(+{row['growth_mib']:7.1f} over the process before the model) | stage "
                    f"weights {row['stage_weights_mib']:6.1f} MiB of {model_bytes / MIB:.0f} | "
                    f"growth = {row['growth_over_stage_weights']:.2f}x stage weights",
                    flush=True,
                )
    if args.out is not None:
        write_json(args.out, {"model_weight_mib": round(model_bytes / MIB, 1), "rows": rows})
    return 0
