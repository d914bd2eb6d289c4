"""Flat vs hierarchical allreduce across emulated nodes (default 2 x 2 ranks), slow links between.

Each node is a network namespace holding its ranks (they reach each other over its loopback)
joined to the other node by one rate-limited link (``tc tbf``), as on a cluster whose nodes
have fast internal links and a slow network between them
(:func:`syncline.testing.emulated.run_ranks_emulated` with ``ranks_per_host``). Every run
trains the default GPT with :class:`~syncline.DataParallel`, the same bucket plan for both
algorithms, and each algorithm runs in processes of its own, the two taking turns (ABBA) for
``--rounds`` rounds; the ratio reported is the median of the per-round ratios.

Per step (medians of each round's steps): wall time, the compute-only time (the same step
under ``no_sync()``, no communication at all: the bound), and the exposed communication
(the wait at the end of backward, ``last_stats.exposed_comm_s``); communication that hid
behind backward is ``wall - compute - exposed`` away from zero only by noise.

    sudo .venv/bin/python -m benchmarks.hierarchical --rates 100mbit,1gbit \\
        --out benchmarks/results/hierarchical.json

What bytes allow: a flat ring over ``p = nodes x ranks_per_node`` ranks (the ranks of a node
adjacent in it) sends ``2 (p-1)/p`` of the gradient out of each node, the hierarchical one
``2 (n-1)/n`` (its inter-node phase moves each rank's ``1/r`` shard), and a node cannot send
less than the latter without compression. The report states that ratio
(``comm_bound_ratio``): 1.5 at 2 x 2, 1.75 at 2 x 4. ``--ranks-per-node 4`` with a small
``--batch`` puts 8 ranks on this machine's cores with little compute each.

Floor (issue 16): hierarchical >= 1.6x flat at 100 Mbit/s between nodes.
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

from syncline import DataParallel, comm
from syncline.comm.hierarchical import HierarchicalAllreduce
from syncline.comm.topology import Topology
from syncline.data import ShardedBatches
from syncline.launch.netns import EmulatedNetwork, check_prerequisites
from syncline.models import model_loss
from syncline.testing.bench import abba, paired_ratios, write_json
from syncline.testing.emulated import run_ranks_emulated
from syncline.train.common import build_dataset, build_model_for
from syncline.train.config import TrainConfig

ENGINES = ("flat", "hierarchical")


def comm_bound_ratio(nodes: int, per_node: int) -> float:
    """Bytes out of a node, flat ring over hierarchical: the most the latter can gain."""
    p = nodes * per_node
    return ((p - 1) / p) / ((nodes - 1) / nodes)


def _rank(rank: int, world: int, engine: str, a: dict[str, Any]) -> dict[str, Any]:
    cfg = TrainConfig(model="gpt", batch_size=a["batch"])
    loss_fn = model_loss("gpt")
    dataset, _ = build_dataset(cfg)
    batches = ShardedBatches(dataset, cfg.batch_size, rank, world, cfg.seed)
    model = build_model_for(cfg)
    allreduce: Any = "flat"
    if engine == "hierarchical":
        allreduce = HierarchicalAllreduce(Topology(world, a["per_node"]), timeout_s=300).build()
    dp = DataParallel(model, bucket_cap_mb=a["bucket_mb"], allreduce=allreduce)
    opt = torch.optim.AdamW(dp.parameters(), lr=1e-3)

    def step(i: int, sync: bool) -> float:
        x, y = batches.batch(i)
        comm.barrier(what="step start")
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if sync:
            loss_fn(dp(x), y).backward()
        else:
            with dp.no_sync():
                loss_fn(dp(x), y).backward()
        opt.step()
        return time.perf_counter() - t0

    for i in range(a["warmup"]):
        step(i, True)
    wall, compute, exposed = [], [], []
    for i in range(a["steps"]):
        wall.append(step(a["warmup"] + i, True))
        exposed.append(dp.last_stats.exposed_comm_s)
        compute.append(step(a["warmup"] + i, False))
    early = getattr(allreduce, "early_starts", None)
    return {
        "wall_s": statistics.median(wall),
        "compute_s": statistics.median(compute),
        "exposed_s": statistics.median(exposed),
        "buckets": len(dp.bucket_plan.buckets),
        "early_starts": dict(early) if early is not None else None,
    }


def _rate(rate: str, a: argparse.Namespace) -> dict[str, Any]:
    settings = {k: getattr(a, k) for k in ("batch", "bucket_mb", "warmup", "steps")}
    settings["per_node"] = a.ranks_per_node
    rounds: dict[str, list[dict[str, Any]]] = {e: [] for e in ENGINES}
    with EmulatedNetwork(a.nodes, rate) as net:
        for r in range(a.rounds):
            for engine in abba(ENGINES, r):
                res = run_ranks_emulated(
                    net, _rank, engine, settings, timeout_s=1800, comm_timeout_s=600,
                    ranks_per_host=a.ranks_per_node,
                )  # fmt: skip
                slowest = max(res, key=lambda x: x["wall_s"])
                rounds[engine].append({**slowest, "per_rank_wall_s": [x["wall_s"] for x in res]})
                print(f"  {rate} round {r} {engine:12s}: {slowest['wall_s'] * 1e3:7.1f} ms/step "
                      f"(compute {slowest['compute_s'] * 1e3:.1f}, exposed "
                      f"{slowest['exposed_s'] * 1e3:.1f})", flush=True)  # fmt: skip
    sps = {e: [a.batch / x["wall_s"] for x in rounds[e]] for e in ENGINES}
    ratios = paired_ratios(sps["hierarchical"], sps["flat"])
    return {
        "samples_per_s": {e: statistics.median(v) for e, v in sps.items()},
        "median_round_ratio_hierarchical_over_flat": statistics.median(ratios),
        "round_ratios": ratios,
        "per_step_ms": {
            e: {
                k: 1e3 * statistics.median(x[k] for x in rounds[e])
                for k in ("wall_s", "compute_s", "exposed_s")
            }
            for e in ENGINES
        },
        "rounds": rounds,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.hierarchical", description=__doc__)
    ap.add_argument("--rates", default="100mbit,1gbit", help="link rates between the nodes")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32, help="global batch")
    ap.add_argument("--bucket-mb", type=float, default=1.0, help="bucket cap, both algorithms")
    ap.add_argument("--nodes", type=int, default=2, help="emulated nodes, >= 2")
    ap.add_argument("--ranks-per-node", type=int, default=2, help="ranks in each node, >= 2")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    if a.nodes < 2 or a.ranks_per_node < 2:
        ap.error(f"--nodes={a.nodes} and --ranks-per-node={a.ranks_per_node} must be >= 2")
    if a.batch % (a.nodes * a.ranks_per_node):
        ap.error(f"--batch={a.batch} must be a multiple of the {a.nodes * a.ranks_per_node} ranks")
    check_prerequisites()
    config = {k: v for k, v in vars(a).items() if k != "out"}
    config.update(
        model="gpt (default)", comm_bound_ratio=comm_bound_ratio(a.nodes, a.ranks_per_node)
    )
    report: dict[str, Any] = {"config": config, "rates": {}}
    for rate in a.rates.split(","):
        report["rates"][rate] = _rate(rate, a)
        r = report["rates"][rate]
        print(f"{rate}: hierarchical {r['median_round_ratio_hierarchical_over_flat']:.3f}x flat")
    if a.out is not None:
        write_json(a.out, report, indent=2)
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "rounds"}
                      for k, v in report["rates"].items()}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
