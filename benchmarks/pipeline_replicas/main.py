"""2BW x 2 replicas with a slow link between the replicas: REDUCE overlap, with and without CSC.

Two emulated nodes (network namespaces joined by a ``tc tbf`` link of ``--rate``), each
holding one 2-stage pipeline (its two ranks talk over the node's loopback); stage ``s`` of
one pipeline averages its gradient with stage ``s`` of the other across the slow link (the
data-parallel groups are ``(0, 2)`` and ``(1, 3)``). Engines, each in processes of its own,
taking turns (ABBA) for ``--rounds`` rounds:

- ``2bw-nosync``: the same two pipelines with no replicas' REDUCE at all: the compute-only
  bound;
- ``2bw`` / ``2bw-csc``: replicas averaging losslessly / with CSC at 1 %, REDUCE in
  ``--bucket-mb`` buckets, each started inside the stage's last backward of the batch
  (:mod:`syncline.pipeline.reduce_buckets`);
- ``2bw-1bucket`` / ``2bw-csc-1bucket``: one bucket per stage, which can start only once
  the whole stage gradient is final: what the overlap saves is the difference.

Per step (medians): wall time; from each rank's action timeline, the time in FORWARD,
BACKWARD and RECOMPUTE (compute) and the time in REDUCE (the averaging that did not hide
behind the backward), on the slowest rank.

    sudo .venv/bin/python -m benchmarks.pipeline_replicas --rate 100mbit \\
        --out benchmarks/results/pipeline_replicas.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from syncline import comm
from syncline.data import ByteDataset, stdlib_corpus
from syncline.dp.compressors import CSC
from syncline.launch.netns import EmulatedNetwork, check_prerequisites
from syncline.models import build_model, lm_loss
from syncline.pipeline import Pipeline
from syncline.schedule import ActionKind
from syncline.testing.bench import abba, paired_ratios, write_json
from syncline.testing.emulated import run_ranks_emulated

ENGINES = ("2bw-nosync", "2bw", "2bw-1bucket", "2bw-csc", "2bw-csc-1bucket")
COMPUTE = (ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.RECOMPUTE)


def _rank(rank: int, world: int, engine: str, a: dict[str, Any]) -> dict[str, Any]:
    # pipelines inside a node, replicas across: new_group is collective, every rank makes all
    groups = [dist.new_group(r) for r in ([0, 1], [2, 3], [0, 2], [1, 3])]
    pipe_group, dp_group = groups[rank // 2], groups[2 + rank % 2]
    sync = engine != "2bw-nosync"
    torch.manual_seed(0)
    model = build_model("gpt", n_layer=a["layers"], n_embd=a["embd"], n_head=4, block_size=a["seq"])
    pipe = Pipeline(
        model,
        num_stages=2,
        num_microbatches=a["micro"],
        schedule="2bw",
        loss_fn=lm_loss,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
        balance=a["balance"],
        process_group=pipe_group,
        data_parallel_group=dp_group if sync else None,
        compression=CSC(0.01) if "csc" in engine else None,
        reduce_bucket_mb=0.0 if "1bucket" in engine else a["bucket_mb"],
        timeout_s=600,
    )
    data = ByteDataset(stdlib_corpus(400_000), a["seq"])
    g = torch.Generator().manual_seed(1 + rank // 2)  # each replica its own shard
    per_replica = a["batch"] // 2
    total = a["warmup"] + a["steps"] + 2
    batches = iter(
        [data.get(torch.randint(0, len(data), (per_replica,), generator=g)) for _ in range(total)]
    )
    for _ in range(a["warmup"]):
        pipe.train_step(batches)
    comm.barrier(what="timed start")
    first_event = len(pipe.trace().events[rank % 2])
    t0 = time.perf_counter()
    for _ in range(a["steps"]):
        pipe.train_step(batches)
    comm.barrier(what="timed end")
    wall = (time.perf_counter() - t0) / a["steps"]
    events = pipe.trace().events[rank % 2][first_event:]
    spent = {"compute": 0.0, "reduce": 0.0}
    for e in events:
        if e.action.kind in COMPUTE:
            spent["compute"] += e.end - e.start
        elif e.action.kind is ActionKind.REDUCE:
            spent["reduce"] += e.end - e.start
    return {
        "wall_s": wall,
        "compute_s": spent["compute"] / a["steps"],
        "reduce_wait_s": spent["reduce"] / a["steps"],
        "reduce_bytes_per_step": pipe.wire_bytes["reduce"] / (a["warmup"] + a["steps"]),
        "early_buckets": pipe.early_reduce_buckets,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.pipeline_replicas", description=__doc__)
    ap.add_argument("--rate", default="100mbit", help="the link between the replicas' nodes")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32, help="global batch (both replicas)")
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--bucket-mb", type=float, default=1.0)
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    check_prerequisites()
    engines = a.engines.split(",")
    layers = a.layers + 2
    settings = {k: getattr(a, k) for k in ("steps", "warmup", "layers", "embd", "seq", "batch",
                                           "micro", "bucket_mb")}  # fmt: skip
    settings["balance"] = [layers // 2 + layers % 2, layers // 2]
    rounds: dict[str, list[dict[str, Any]]] = {e: [] for e in engines}
    with EmulatedNetwork(2, a.rate) as net:
        for r in range(a.rounds):
            for engine in abba(engines, r):
                res = run_ranks_emulated(
                    net, _rank, engine, settings, timeout_s=1800, comm_timeout_s=600,
                    ranks_per_host=2,
                )  # fmt: skip
                slowest = max(res, key=lambda x: x["wall_s"])
                rounds[engine].append(
                    {**slowest, "max_reduce_wait_s": max(x["reduce_wait_s"] for x in res)}
                )
                wait = rounds[engine][-1]["max_reduce_wait_s"]
                print(f"  round {r} {engine:16s} {slowest['wall_s'] * 1e3:8.1f} ms/step "
                      f"(compute {slowest['compute_s'] * 1e3:.1f}, REDUCE wait "
                      f"{wait * 1e3:.1f})", flush=True)  # fmt: skip
    sps = {e: [a.batch / x["wall_s"] for x in rounds[e]] for e in engines}
    bound = "2bw-nosync"
    report: dict[str, Any] = {
        "config": {**{k: v for k, v in vars(a).items() if k != "out"}, **settings},
        "samples_per_s": {e: statistics.median(v) for e, v in sps.items()},
        "per_step_ms": {
            e: {
                k: 1e3 * statistics.median(x[k] for x in rounds[e])
                for k in ("wall_s", "compute_s", "max_reduce_wait_s")
            }
            for e in engines
        },
        "median_round_ratios": {},
        "rounds": rounds,
    }
    pairs = [("2bw", "2bw-1bucket"), ("2bw-csc", "2bw-csc-1bucket"), ("2bw-csc", "2bw")]
    pairs += [(e, bound) for e in engines if e != bound]
    for x, y in pairs:
        if x in sps and y in sps:
            report["median_round_ratios"][f"{x}_over_{y}"] = statistics.median(
                paired_ratios(sps[x], sps[y])
            )
    if a.out is not None:
        write_json(a.out, report, indent=2)
    print(json.dumps({k: v for k, v in report.items() if k != "rounds"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
