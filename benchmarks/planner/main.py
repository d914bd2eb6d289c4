"""The planner checked against reality: predicted vs measured step time and peak memory.

For each network (the loopback, and 2 ranks over emulated links), this runs
``syncline plan --profile --json`` for the model, then trains the planner's top candidates
and a spread of the others with ``syncline train`` (each in its own processes, as a user
runs it), and compares per configuration: step time (median over the run's steps, the first
``--skip`` left out; then the median over ``--rounds`` runs, the configurations taking
turns in a rotated order, since this machine's speed drifts over minutes) and peak
resident memory (the largest rank's). Reported: the absolute
percentage error of each, their mean, the Spearman rank correlation of predicted and
measured step times, and how far the planner's pick is from the fastest measured.

    python -m benchmarks.planner --networks loopback,100mbit \\
        --out benchmarks/results/planner.json

Floors (issue 14): step-time error <= 15 % per configuration on the loopback (mean <= 10 %),
peak-memory error <= 10 %, rank correlation >= 0.9, the pick within 5 % of the fastest.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from syncline.testing.bench import write_json

MODEL = ("--model=gpt", "--n-layer=8", "--n-embd=256", "--n-head=4", "--seq-len=64")


def _syncline(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "syncline.cli.main", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)


def plan(network: str, model: list[str], batch: int, out: Path) -> dict[str, Any]:
    args = ["plan", *model, f"--batch-size={batch}", "--profile", "--json", "--top=1000"]
    args.append(f"--profile-out={out / f'profile-{network}.json'}")
    if network != "loopback":
        args.append(f"--emulate-network={network}")
    res = _syncline(args, 900)
    if res.returncode:
        raise SystemExit(f"syncline plan failed:\n{res.stderr[-3000:]}")
    doc: dict[str, Any] = json.loads(res.stdout)
    return doc


def spread(candidates: list[dict[str, Any]], top: int, count: int) -> list[dict[str, Any]]:
    """The ``top`` best, then others whose predicted step times are evenly spaced between
    the best's and the slowest fitting one's (fitting ones only; at each point the nearest
    not yet chosen, a kind (dp compressor, schedule) not yet measured first when as near).

    Spaced by predicted time, not by place in the ranking: the ranking is dense with near
    ties at the top, and a rank correlation over configurations whose true times differ
    less than the machine's run-to-run noise measures the noise, not the planner.
    """
    fitting = [c for c in candidates if c["fits"]]
    chosen = fitting[:top]
    rest = fitting[top:]
    if not rest or len(chosen) >= count:
        return chosen[:count]
    lo, hi = rest[0]["predicted_step_s"], max(c["predicted_step_s"] for c in rest)
    points = count - len(chosen)
    for j in range(points):
        target = lo + (hi - lo) * (j + 1) / points
        seen = {c["schedule"] or f"dp {c['compression']}" for c in chosen}
        pool = [c for c in rest if c not in chosen]
        if not pool:
            break

        def distance(c: dict[str, Any], target: float = target, seen: set[str] = seen) -> float:
            kind = c["schedule"] or f"dp {c['compression']}"
            # a new kind wins over a repeat up to 5 % of the span away
            return abs(c["predicted_step_s"] - target) + (0.05 * (hi - lo) if kind in seen else 0)

        chosen.append(min(pool, key=distance))
    return chosen


def measure(
    candidate: dict[str, Any], network: str, steps: int, skip: int, run_dir: Path
) -> dict[str, Any]:
    args = ["train", *candidate["model_args"], *candidate["train_args"]]
    args += [f"--steps={steps}", "--log-every=1", f"--warmup-steps={min(5, steps)}"]
    args += [f"--checkpoint-every={steps + 1}", f"--run-dir={run_dir}"]
    t0 = time.perf_counter()
    res = _syncline(args, 1800)
    wall = time.perf_counter() - t0
    if res.returncode:
        return {"error": res.stderr[-2000:], "wall_s": wall}
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_s"] for r in records if r["step"] >= skip]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "step_s": statistics.median(times),
        "peak_bytes": max(summary["peak_rss_bytes_per_rank"]),
        "peak_bytes_per_rank": summary["peak_rss_bytes_per_rank"],
        "wall_s": wall,
    }


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's runs over the rounds: the median step time and peak memory."""
    ok = [r for r in runs if "step_s" in r]
    if not ok:
        return runs[-1]
    return {
        "step_s": statistics.median(r["step_s"] for r in ok),
        "peak_bytes": statistics.median(r["peak_bytes"] for r in ok),
        "step_s_per_round": [r["step_s"] for r in ok],
        "peak_bytes_per_round": [r["peak_bytes"] for r in ok],
        "wall_s": sum(r["wall_s"] for r in runs),
        "failed_rounds": len(runs) - len(ok),
    }


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2
        i = j + 1
    return ranks


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else 0.0


def compare(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in rows if "step_s" in r["measured"]]
    if not ok:
        return {}
    for r in ok:
        m, p = r["measured"], r["predicted"]
        r["step_error"] = abs(p["step_s"] - m["step_s"]) / m["step_s"]
        r["memory_error"] = abs(p["peak_bytes"] - m["peak_bytes"]) / m["peak_bytes"]
    fastest = min(r["measured"]["step_s"] for r in ok)
    pick = ok[0]  # rows keep the planner's order; the first is its pick
    return {
        "configurations": len(ok),
        "mean_step_error": statistics.mean(r["step_error"] for r in ok),
        "max_step_error": max(r["step_error"] for r in ok),
        "mean_memory_error": statistics.mean(r["memory_error"] for r in ok),
        "max_memory_error": max(r["memory_error"] for r in ok),
        "rank_correlation": spearman(
            [r["predicted"]["step_s"] for r in ok], [r["measured"]["step_s"] for r in ok]
        ),
        "pick": pick["label"],
        "pick_vs_fastest": pick["measured"]["step_s"] / fastest - 1.0,
        "fastest": min(ok, key=lambda r: r["measured"]["step_s"])["label"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.planner", description=__doc__)
    ap.add_argument("--networks", default="loopback,100mbit")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--configs", type=int, default=8, help="configurations per network")
    ap.add_argument("--top", type=int, default=3, help="of which the planner's best")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3, help="runs of each configuration, in turns")
    ap.add_argument("--skip", type=int, default=4, help="first steps left out of the median")
    ap.add_argument("--work", type=Path, default=Path("runs/bench-planner"))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("model", nargs="*", default=list(MODEL), help="syncline train model options")
    a = ap.parse_args(argv)
    result: dict[str, Any] = {"model": a.model, "batch_size": a.batch_size, "networks": {}}
    for network in a.networks.split(","):
        doc = plan(network, a.model, a.batch_size, a.work)
        chosen = spread(doc["candidates"], a.top, a.configs)
        runs: list[list[dict[str, Any]]] = [[] for _ in chosen]
        for r in range(a.rounds):  # take turns, each round in a rotated order
            order = [(i + r) % len(chosen) for i in range(len(chosen))]
            for i in order:
                c = chosen[i]
                print(f"[{network}] round {r + 1}/{a.rounds}: {c['label']} ...", flush=True)
                runs[i].append(measure(c, network, a.steps, a.skip, a.work / f"{network}-{i}"))
        rows = []
        for i, c in enumerate(chosen):
            measured = combine(runs[i])
            row = {
                "label": c["label"],
                "planner_rank": doc["candidates"].index(c) + 1,
                "train_args": c["train_args"],
                "predicted": {
                    "step_s": c["predicted_step_s"],
                    "peak_bytes": c["predicted_peak_bytes"],
                    "breakdown_s": c["breakdown_s"],
                },
                "measured": measured,
            }
            rows.append(row)
            if "step_s" in measured:
                print(
                    f"    predicted {c['predicted_step_s'] * 1e3:8.1f} ms "
                    f"{c['predicted_peak_bytes'] / 2**20:7.1f} MiB | measured "
                    f"{measured['step_s'] * 1e3:8.1f} ms {measured['peak_bytes'] / 2**20:7.1f} MiB",
                    flush=True,
                )
            else:
                print(f"    failed: {measured['error'][-300:]}", flush=True)
        summary = compare(rows)
        print(f"[{network}] {json.dumps(summary)}", flush=True)
        result["networks"][network] = {
            "cluster": doc["cluster"],
            "candidates_ranked": len(doc["candidates"]),
            "rows": rows,
            "summary": summary,
        }
    if a.out is not None:
        write_json(a.out, result, indent=2)
    return 0
