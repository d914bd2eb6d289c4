"""What each compressor costs in local compute per step, on the default ``syncline train`` GPT.

On a fast network (loopback) a compressor pays for itself only if its local work (scoring,
packing, factorising, unpacking) costs less than the bytes it saves. This script isolates that
work: one process, world size 1 (the collectives are real but have nobody to talk to, so they
cost nothing), the real bucket layout of the default GPT (same plan and per-parameter layout
as :class:`syncline.DataParallel` builds), fresh random gradients every step, and the median
wall time of ``reduce`` + ``wait`` over every bucket of a step.

    python -m benchmarks.compressor_cost --steps 30 --out benchmarks/results/compressor_cost.json

Numbers are for same-run comparison: absolute times depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from syncline.comm.collectives import FlatAllreduce
from syncline.dp.buckets import plan_buckets
from syncline.dp.compression import BucketRef
from syncline.dp.compressors import build_compressor
from syncline.dp.config import DataParallelConfig
from syncline.testing.bench import write_json
from syncline.train.config import TrainConfig
from syncline.train.trainer import build_model_for

SPECS = (
    "none",
    "fp16",
    "bf16",
    "csc:0.01",
    "csc:0.01:chunk=256",
    "topk:0.01",
    "powersgd:4",
)


def _buckets(model: torch.nn.Module) -> list[tuple[int, int, Any]]:
    """``(start, end, layout)`` per bucket, as DataParallel plans them before its first step."""
    params = [p for p in model.parameters() if p.requires_grad]
    cfg = DataParallelConfig()
    order = list(reversed(range(len(params))))
    plan = plan_buckets([p.numel() for p in params], order, 4, cfg.cap_bytes, cfg.first_cap_bytes)
    return [
        (
            b.start,
            b.end,
            tuple((plan.offsets[i] - b.start, tuple(params[i].shape)) for i in b.params),
        )
        for b in plan.buckets
    ]


def _ref(index: int, step: int, layout: Any) -> BucketRef:
    try:
        return BucketRef(index, step, layout)
    except TypeError:  # a syncline from before BucketRef carried layouts (for "before" runs)
        return BucketRef(index, step)


def time_spec(spec: str, buckets: list[tuple[int, int, Any]], steps: int, warmup: int) -> dict:
    comm = FlatAllreduce()
    comp = build_compressor(spec)
    total = buckets[-1][1]
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(total, generator=gen) for _ in range(4)]
    flat = torch.empty(total)
    times = []
    for step in range(1, warmup + steps + 1):
        flat.copy_(grads[step % len(grads)])
        t0 = time.perf_counter()
        pending = [
            comp.reduce(_ref(i, step, layout), flat[a:b], comm)
            for i, (a, b, layout) in enumerate(buckets)
        ]
        for p in pending:
            p.wait()
        if step > warmup:
            times.append(time.perf_counter() - t0)
    return {"median_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.compressor_cost", description=(__doc__ or "").splitlines()[0]
    )
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a rank's share)")
    ap.add_argument("--specs", default=",".join(SPECS))
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = build_model_for(TrainConfig())
    buckets = _buckets(model)
    result: dict[str, Any] = {
        "numel": buckets[-1][1],
        "buckets": [b - s for s, b, _ in buckets],
        "threads": a.threads,
        "torch": torch.__version__,
        "specs": {},
    }
    for spec in a.specs.split(","):
        result["specs"][spec] = time_spec(spec, buckets, a.steps, a.warmup)
        r = result["specs"][spec]
        print(f"{spec:22s} median {r['median_ms']:7.2f} ms  min {r['min_ms']:7.2f} ms", flush=True)
    if a.out is not None:
        write_json(a.out, result, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit("run it from the repository root as: python -m benchmarks.compressor_cost")
