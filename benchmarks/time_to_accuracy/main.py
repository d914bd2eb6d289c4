"""Time to accuracy: each engine trained, in its own processes, to the held-out loss plain DDP
reaches after N steps; wall time and steps to it, and the ratio to the best DDP hook.

Bytes per step are not what a user buys; time to a given loss is. Two emulated hosts (one
rank each, its own network namespace, links capped at ``--rate`` by ``tc tbf``) train the
byte-level GPT of :mod:`benchmarks.lowbw` (its engines: DDP plain and with torch's fp16 and
PowerSGD hooks, syncline with each compressor) from the same initialisation on the same
batches.

1. Target: plain DDP trains ``--ddp-steps`` (N) steps; its held-out loss then is the target
   (held-out: bytes after the training corpus, never trained on).
2. Rounds: every engine trains until its held-out loss, measured every ``--eval-every``
   steps, is at most the target, or ``--max-steps-factor`` x N steps pass. Each engine runs
   in fresh processes, one after the other, the order rotating every round (reversed on odd
   rounds), so drift of the shared machine's load favours none. Training time only: the
   evaluations are not counted. The time and step of reaching the target are interpolated
   linearly between the two evaluations around the crossing (``eval_step`` is the
   evaluation that saw it).
3. Figures per engine: median over the rounds of the wall time and steps to the target; the
   ratios of each engine's median to the best DDP configuration's (DDP or a hook, the
   fastest to the target) and to plain DDP's, with each round's ratio (the spread).

An engine spec may override settings: ``powersgd@powersgd_rank=1`` or
``csc@density=0.1,chunk_elems=1024`` (the keys of :func:`benchmarks.lowbw.main.settings`).

    sudo .venv/bin/python -m benchmarks.time_to_accuracy                    # 100 Mbit/s
    sudo .venv/bin/python -m benchmarks.time_to_accuracy --rate 1gbit
    .venv/bin/python -m benchmarks.time_to_accuracy --loopback --ddp-steps 20 --rounds 1

Results: ``benchmarks/results/time_to_accuracy_<rate>_<layers>x<width>.json`` and a plot of
held-out loss against wall time beside it (``.png``, needs matplotlib).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.lowbw.engines import CONFIGS
from benchmarks.lowbw.main import add_training_options, settings
from benchmarks.time_to_accuracy.ranks import train_to_target
from syncline.launch.netns import EmulatedNetwork, check_prerequisites
from syncline.testing import run_ranks
from syncline.testing.bench import abba, ratio, rotated, write_json

WORLD = 2
RESULTS = Path(__file__).resolve().parents[1] / "results"
DEFAULT_CONFIGS = (
    "ddp",
    "ddp-fp16",
    "ddp-powersgd@powersgd_rank=1",
    "ddp-powersgd@powersgd_rank=4",
    "fp16",
    "powersgd@powersgd_rank=1",
    "powersgd@powersgd_rank=4",
    "csc",
)


def parse_engine(spec: str, s: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """``name@key=value,...`` -> (lowbw engine name, its settings); bad specs exit naming
    the valid names or keys."""
    name, _, rest = spec.partition("@")
    if name not in CONFIGS:
        raise SystemExit(f"time_to_accuracy: unknown engine {name!r}; valid: {', '.join(CONFIGS)}")
    mine = dict(s)
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in s:
            raise SystemExit(
                f"time_to_accuracy: bad override {item!r} in {spec!r}; keys: {', '.join(s)}"
            )
        mine[key] = type(s[key])(value)
    return name, mine


def _run(
    net: EmulatedNetwork | None,
    spec: str,
    engine: tuple[str, dict[str, Any]],
    a: argparse.Namespace,
    target: float | None,
    max_steps: int,
) -> dict[str, Any]:
    name, mine = engine
    args = (mine, name, target, max_steps)
    kw: dict[str, Any] = {"timeout_s": a.config_timeout, "comm_timeout_s": a.comm_timeout}
    if net is None:
        res = run_ranks(train_to_target, WORLD, *args, **kw)[0]
    else:
        from syncline.testing.emulated import run_ranks_emulated

        res = run_ranks_emulated(net, train_to_target, *args, **kw)[0]
    res["spec"] = spec
    return dict(res)


def _summary(runs: dict[str, list[dict[str, Any]]], ddp_names: list[str]) -> dict[str, Any]:
    """Medians per engine and the ratios to the best DDP configuration and to plain DDP."""
    out: dict[str, Any] = {}
    for spec, rs in runs.items():
        times = [r["reached"]["wall_s"] if r["reached"] else None for r in rs]
        steps = [r["reached"]["step"] if r["reached"] else None for r in rs]
        ok = [t for t in times if t is not None]
        every = len(ok) == len(rs)
        out[spec] = {
            "reached_in_rounds": len(ok),
            "rounds": len(rs),
            "time_to_target_s": times,
            "steps_to_target": steps,
            "time_to_target_s_median": statistics.median(ok) if every else None,
            "steps_to_target_median": statistics.median(steps) if every else None,  # type: ignore[type-var]
            "seconds_per_step_median": statistics.median(
                r["wall_s"] / max(1, r["steps_run"]) for r in rs
            ),
        }
    finished = [n for n in ddp_names if out.get(n, {}).get("time_to_target_s_median")]
    best = min(finished, key=lambda n: out[n]["time_to_target_s_median"]) if finished else None
    for summ in out.values():
        for label, ref in (("best_ddp", best), ("ddp", "ddp" if "ddp" in out else None)):
            med = summ["time_to_target_s_median"]
            ref_med = out[ref]["time_to_target_s_median"] if ref else None
            summ[f"speedup_vs_{label}"] = ratio(ref_med, med)
            if ref is not None:  # each round's own ratio: the spread
                pairs = zip(out[ref]["time_to_target_s"], summ["time_to_target_s"], strict=True)
                summ[f"speedup_vs_{label}_per_round"] = [ratio(b, t) for b, t in pairs]
    return {"best_ddp_configuration": best, "engines": out}


def _plot(path: Path, runs: dict[str, list[dict[str, Any]]], target: float) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("time_to_accuracy: matplotlib missing, no plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    for spec, rs in runs.items():
        curve = rs[0]["curve"]
        ax.plot([p["wall_s"] for p in curve], [p["heldout_loss"] for p in curve], label=spec)
    ax.axhline(target, color="k", linestyle=":", label="DDP's N-step loss")
    ax.set_xlabel("training wall time (s), round 1")
    ax.set_ylabel("held-out loss")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.time_to_accuracy", description=(__doc__ or "").splitlines()[0]
    )
    ap.add_argument("--rate", default="100mbit", help="per-host link rate (tc units)")
    ap.add_argument("--loopback", action="store_true", help="127.0.0.1 instead of emulated hosts")
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS).replace(",", " "),
                    help="space-separated engine specs (name[@key=value,...])")  # fmt: skip
    ap.add_argument("--ddp-steps", type=int, default=300, help="N: DDP's steps to the target")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-steps-factor", type=float, default=3.0)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--eval-batch", type=int, default=16)
    ap.add_argument("--eval-bytes", type=int, default=200_000)
    ap.add_argument("--comm-timeout", type=float, default=300.0)
    ap.add_argument("--config-timeout", type=float, default=3600.0)
    ap.add_argument("--out", default="", help="JSON path (default: under benchmarks/results)")
    add_training_options(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    s = settings(a)
    s.update(eval_every=a.eval_every, eval_batches=a.eval_batches, eval_batch=a.eval_batch,
             eval_bytes=a.eval_bytes)  # fmt: skip
    specs = a.configs.split()
    engines = {spec: parse_engine(spec, s) for spec in specs}  # all refused before any run
    rate = "loopback" if a.loopback else a.rate
    out = Path(a.out or RESULTS / f"time_to_accuracy_{rate}_{a.n_layer}x{a.n_embd}.json")
    started = time.perf_counter()
    net: EmulatedNetwork | None = None
    if a.loopback:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    else:
        check_prerequisites()
        net = EmulatedNetwork(WORLD, a.rate)
    try:
        if net is not None:
            net.__enter__()
        ref = _run(net, "ddp", ("ddp", s), a, None, a.ddp_steps)
        target = ref["curve"][-1]["heldout_loss"]
        print(f"[tta] target: DDP's held-out loss after {a.ddp_steps} steps = {target:.4f}")
        max_steps = int(a.max_steps_factor * a.ddp_steps)
        runs: dict[str, list[dict[str, Any]]] = {spec: [] for spec in specs}
        for r in range(a.rounds):
            for spec in abba(rotated(specs, r), r):
                res = _run(net, spec, engines[spec], a, target, max_steps)
                runs[spec].append(res)
                got = res["reached"]
                print(f"[tta] round {r + 1} {spec}: "
                      + (f"{got['wall_s']:.1f} s, {got['step']} steps" if got
                         else f"not reached in {res['steps_run']} steps"), flush=True)  # fmt: skip
    finally:
        if net is not None:
            net.__exit__(None, None, None)
    ddp_names = [spec for spec, (name, _) in engines.items() if name.startswith("ddp")]
    doc = {
        "rate": rate,
        "world_size": WORLD,
        "settings": s,
        "ddp_steps": a.ddp_steps,
        "target_heldout_loss": target,
        "target_run": ref,
        "rounds": a.rounds,
        "max_steps": max_steps,
        "wall_seconds": time.perf_counter() - started,
        **_summary(runs, ddp_names),
        "runs": runs,
    }
    write_json(out, doc, indent=1)
    _plot(out.with_suffix(".png"), runs, target)
    for spec, summ in doc["engines"].items():
        print(
            f"{spec:32s} {summ['time_to_target_s_median']} s, "
            f"steps {summ['steps_to_target_median']}, vs best DDP {summ['speedup_vs_best_ddp']}, "
            f"vs DDP {summ['speedup_vs_ddp']}"
        )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit("run it from the repository root as: python -m benchmarks.time_to_accuracy")
