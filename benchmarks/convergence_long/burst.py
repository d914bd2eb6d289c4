"""Why CSC at high sparsity diverged: how old, and how large, is each chunk it sends?

Trains CSC on 2 loopback ranks and records, for every chunk sent after the dense warm-up, the
steps since that chunk was last sent (its age), the norm of what it applied against the
norm of one step's local momentum ``u`` on the same elements (how many steps of velocity
arrive at once), the largest element it applied, and the parameters it spans. A chunk much
larger than the layers it covers is sent rarely, and then delivers its whole accumulated
velocity in one step.

    python -m benchmarks.convergence_long.burst --spec csc:0.01:warmup=2 --steps 150
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch

from syncline.testing import run_ranks

RESULTS = Path(__file__).resolve().parents[1] / "results" / "convergence_long_burst.json"


def _rank(rank: int, world: int, s: dict[str, Any]) -> dict[str, Any]:
    from syncline import DataParallel
    from syncline.data import ByteDataset, ShardedBatches, stdlib_corpus
    from syncline.dp import build_compressor
    from syncline.models import build_model, lm_loss

    data = ByteDataset(stdlib_corpus(4_000_000), 64).split(0.05)[0]
    torch.manual_seed(0)
    model = build_model("gpt", n_layer=4, n_embd=s["n_embd"], n_head=4, block_size=64)
    comp = build_compressor(s["spec"])
    dp = DataParallel(model, compression=comp, bucket_cap_mb=25.0)
    opt = torch.optim.SGD(dp.parameters(), lr=s["lr"], momentum=0.0)
    batches = ShardedBatches(data, s["global_batch"], rank, world, 0)
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    plan = dp.bucket_plan
    last_sent: dict[tuple[int, int], int] = {}
    events: list[dict[str, Any]] = []
    losses = []
    for step in range(s["steps"]):
        x, y = batches.batch(step)
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(dp(x), y)
        loss.backward()
        losses.append(loss.item())
        flat = torch.zeros(sum(plan.numels))
        for i, p in enumerate(params):
            flat[plan.offsets[i] : plan.offsets[i] + plan.numels[i]] = p.grad.reshape(-1)
        for b in plan.buckets:
            sel = comp.last_selection.get(b.index)
            if sel is None:
                continue
            n = b.end - b.start
            chunk = _chunk(comp, n)
            if sel.numel() == -(-n // chunk):  # a dense step
                continue
            for j in sel.tolist():
                age = step - last_sent.get((b.index, j), 1)
                last_sent[(b.index, j)] = step
                lo, hi = b.start + j * chunk, b.start + min((j + 1) * chunk, n)
                applied = flat[lo:hi]
                spans = [
                    names[i]
                    for i in range(len(params))
                    if plan.offsets[i] < hi and plan.offsets[i] + plan.numels[i] > lo
                ]
                events.append(
                    {
                        "step": step,
                        "bucket": b.index,
                        "chunk": j,
                        "age": age,
                        "elements": hi - lo,
                        "parameters": len(spans),
                        "spans": spans[:3] + (["..."] if len(spans) > 3 else []),
                        "applied_norm": float(applied.norm()),
                        "applied_max": float(applied.abs().max()),
                    }
                )
        opt.step()
    return {"losses": losses, "events": events}


def _chunk(comp: Any, numel: int) -> int:
    """The chunk size CSC uses for a bucket of ``numel`` elements."""
    size = getattr(comp, "chunk_size", None)
    return int(size(numel)) if callable(size) else int(comp.chunk_elems)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.convergence_long.burst")
    ap.add_argument("--spec", default="csc:0.01:warmup=2")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--out", default=str(RESULTS))
    a = ap.parse_args(argv)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    s = {"spec": a.spec, "steps": a.steps, "n_embd": a.n_embd, "lr": a.lr,
         "global_batch": a.global_batch}  # fmt: skip
    res = run_ranks(_rank, 2, s, timeout_s=3600.0)[0]
    Path(a.out).write_text(json.dumps({"settings": s, **res}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
