"""Low-bandwidth data parallelism: syncline's compressors vs torch DDP (and its comm hooks).

Two emulated hosts (one rank each, its own network namespace) joined by a switch whose ports
are capped at ``--rate`` (default 100 Mbit/s) both ways by ``tc tbf``
(:class:`syncline.launch.netns.EmulatedNetwork`). Every configuration trains the same byte-level
GPT on the same stdlib text, from the same initialisation, with the same optimizer, batches and
number of steps; only the data-parallel engine and its gradient compression differ:

    none fp16 bf16 csc topk powersgd        syncline.DataParallel + compressor
    ddp ddp-fp16 ddp-powersgd               torch DDP, plain / fp16_compress_hook / powerSGD_hook

The ranks run on the network's hosts (:func:`syncline.testing.emulated.run_ranks_emulated`),
so their collectives cross the capped links. By default (``--schedule interleaved``) one pair
of ranks trains all configurations side by side, one step of each in turn (order rotating
every step, a barrier before each timed step), so that all of them meet the same background
load on this shared 2-core machine; ``--schedule sequential`` starts one pair of ranks per
configuration. The network is deleted at the end, also on errors and signals.

    sudo .venv/bin/python -m benchmarks.lowbw                     # the full run
    sudo .venv/bin/python -m benchmarks.lowbw --steps 60          # quick look
    .venv/bin/python -m benchmarks.lowbw --loopback               # fast network (127.0.0.1)

Design choices (all are options):

* Model: GPT 4 layers x 256 wide, 4 heads, block 64. Its fp32 gradient takes far longer on a
  100 Mbit/s wire than the compute of 4 sequences of 64 bytes per rank (1 thread per rank):
  the allreduce dominates the step, as in the bandwidth-starved clusters CSC targets.
  Comm/compute does not depend on the parameter count (both scale with it), only on tokens
  per rank, hence the small per-rank batch.
* Optimizer: SGD, momentum 0.9, lr 0.02 (constant), for every configuration; CSC gets
  ``momentum=0`` in SGD and 0.9 inside CSC (momentum correction). SGD does learn within the
  step budget (see the loss curves in the results), so AdamW was not needed. The lr was
  chosen for the *dense* baseline (sweep 0.02 / 0.035 / 0.05 / 0.1 / 0.2, with and without
  warm-up and cosine decay: 0.02-0.035 best, >= 0.1 unstable), not for CSC.
* Warm-up: ``--warmup-steps`` (10 % of the default budget) dense steps for csc and powersgd,
  and DDP's PowerSGD hook gets ``start_powerSGD_iter`` equal to it (DDP requires >= 2). topk
  has no warm-up option. The first ``--warmup-steps`` steps are excluded from the median
  samples/s of *every* configuration (one window for all).
* CSC chunk size: 256 elements, so 1 % density sends about 1 % of the gradient's chunks per
  step (the 32768 default would leave a handful of chunks, and send 2 of them); scores cost
  4 bytes per chunk.
* Buckets: ``--bucket-cap-mb 25`` is passed to both engines, so each has ONE bucket for
  this model (an explicit cap also drops DDP's 1 MiB first bucket). With several buckets
  DDP's PowerSGD hook can deadlock on gloo (observed at 4 MiB: both gloo worker threads
  blocked in the hook's ``wait()``), so the benchmark keeps one bucket and warns otherwise.
* Wire bytes and losses: see :mod:`benchmarks.lowbw.engines` and :mod:`benchmarks.lowbw.report`.

``--loopback`` runs instead on 127.0.0.1 (``syncline.testing.run_ranks``), all engines in one
pair of processes, timed in rotating segments so that drift favours none, and reports each
compressor's samples/s relative to plain DDP (``--loopback-global-batch N`` repeats it at
another batch, stored as ``loopback_batchN``). Results go to ``--out`` (default
``benchmarks/results/lowbw.json``); each mode replaces only its own section of that file.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.lowbw import ranks, report
from benchmarks.lowbw.engines import CONFIGS, SYNCLINE_CONFIGS, gpt_numel
from syncline.launch.netns import EmulatedNetwork, check_prerequisites
from syncline.testing import RankFailure, run_ranks
from syncline.testing.bench import merge_results
from syncline.testing.emulated import run_ranks_emulated

FLOORS = {
    "csc_over_ddp_samples_per_s": 5.0,  # emulated: CSC's median samples/s over DDP's
    "time_to_ddp_final_loss_speedup": 3.0,  # emulated: how much sooner CSC reaches it
    "loopback_min_ratio": 0.9,  # loopback: the slowest compressor's samples/s over DDP's
}
WORLD = 2
PROBE_NUMEL = 1 << 20
PROBE_REPS = 3
RESULTS = Path(__file__).resolve().parents[1] / "results" / "lowbw.json"


def settings(a: argparse.Namespace) -> dict[str, Any]:
    """The run's settings from :func:`add_training_options`'s arguments."""
    if a.global_batch % WORLD:
        raise SystemExit(f"lowbw: --global-batch must be a multiple of {WORLD}")
    return {
        "n_layer": a.n_layer,
        "n_embd": a.n_embd,
        "n_head": a.n_head,
        "block_size": a.block_size,
        "global_batch": a.global_batch,
        "steps": a.steps,
        "warmup_steps": a.warmup_steps,
        "optimizer": "SGD",
        "lr": a.lr,
        "momentum": a.momentum,
        "density": a.density,
        "chunk_elems": a.chunk_elems,
        "topk_ratio": a.topk_ratio,
        "powersgd_rank": a.powersgd_rank,
        "bucket_cap_mb": a.bucket_cap_mb,
        "seed": a.seed,
        "smooth": a.smooth if a.smooth > 0 else max(1, math.ceil(0.1 * a.steps)),
        "corpus_bytes": a.corpus_bytes,
        "threads_per_rank": 1,
    }


def _warn_powersgd_buckets(names: list[str], s: dict[str, Any]) -> None:
    grad_mb = 4 * gpt_numel(s) / 2**20
    if "ddp-powersgd" in names and s["bucket_cap_mb"] < grad_mb:
        print(
            f"[lowbw] warning: --bucket-cap-mb {s['bucket_cap_mb']} < {grad_mb:.1f} MiB of "
            "gradients gives DDP several buckets; its PowerSGD hook then can deadlock on gloo "
            "(its callbacks block gloo's worker threads in wait()); seen here with 4 MiB",
            file=sys.stderr,
            flush=True,
        )


def _emulated(a: argparse.Namespace, s: dict[str, Any]) -> dict[str, Any]:
    check_prerequisites()
    names = [c for c in a.configs.split(",") if c]
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        raise SystemExit(f"lowbw: unknown config(s) {unknown}; valid: {', '.join(CONFIGS)}")
    _warn_powersgd_buckets(names, s)
    raw: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    started = time.perf_counter()
    probe = None
    jobs = [] if a.no_probe else [["probe"]]
    jobs += [names] if a.schedule == "interleaved" else [[name] for name in names]
    with EmulatedNetwork(WORLD, a.rate) as net:
        for job in jobs:
            label = "+".join(job)
            t0 = time.perf_counter()
            fn, args = (
                (ranks.probe_link, (PROBE_NUMEL, PROBE_REPS))
                if job == ["probe"]
                else (ranks.train, (s, job))
            )
            try:
                res = run_ranks_emulated(
                    net,
                    fn,
                    *args,
                    timeout_s=a.config_timeout * (1 if job == ["probe"] else len(job)),
                    comm_timeout_s=a.comm_timeout,
                )[0]
            except RankFailure as exc:
                for name in job:
                    errors[name] = str(exc)
                print(f"[lowbw] {label}: FAILED\n{exc}", file=sys.stderr, flush=True)
                continue
            if job == ["probe"]:
                probe = res
                report.print_probe(res)
                continue
            print(f"[lowbw] {label}: {time.perf_counter() - t0:.0f} s", flush=True)
            for name in job:
                raw[name] = res[name]
                report.print_progress(name, report.summarise(res[name], s))
    summaries = {name: report.summarise(res, s) for name, res in raw.items()}
    if "ddp" in summaries:
        target = summaries["ddp"]["final_loss"]
        for summ in summaries.values():
            summ["time_to_ddp_final_loss"] = report.time_to(summ, target)
    ratios = report.ratios(summaries)
    return {
        "rate": a.rate,
        "world_size": WORLD,
        "schedule": a.schedule,
        "settings": s,
        "link_probe": probe,
        "wall_seconds": time.perf_counter() - started,
        "configs": summaries,
        "ratios": ratios,
        "floors": report.floors_emulated(ratios, FLOORS),
        "errors": errors,
    }


def _loopback(a: argparse.Namespace, s: dict[str, Any]) -> dict[str, Any]:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # 127.0.0.1; the spawned ranks inherit it
    if a.loopback_global_batch:
        if a.loopback_global_batch % WORLD:
            raise SystemExit(f"lowbw: --loopback-global-batch must be a multiple of {WORLD}")
        s = {**s, "global_batch": a.loopback_global_batch}
    names = [c for c in a.loopback_configs.split(",") if c]
    if "ddp" not in names:
        names.append("ddp")
    started = time.perf_counter()
    res = run_ranks(
        ranks.loopback,
        WORLD,
        s,
        names,
        a.loopback_rounds,
        a.loopback_segment,
        timeout_s=a.config_timeout * 2,
        comm_timeout_s=a.comm_timeout,
    )[0]
    summary = report.summarise_loopback(res, s, names, a.loopback_segment, FLOORS)
    return {
        "settings": s,
        "rounds": a.loopback_rounds,
        "steps_per_segment": a.loopback_segment,
        "wall_seconds": time.perf_counter() - started,
        **summary,
    }


def add_training_options(ap: argparse.ArgumentParser) -> None:
    """The model, data, optimizer and compressor settings (:func:`settings` reads them): the
    same for every benchmark that trains lowbw's engines."""
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--warmup-steps", type=int, default=15)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--global-batch", type=int, default=8, help="sequences per step, all ranks")
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--chunk-elems", type=int, default=256)
    ap.add_argument("--topk-ratio", type=float, default=0.01)
    ap.add_argument("--powersgd-rank", type=int, default=4)
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--smooth",
        type=int,
        default=0,
        help="loss smoothing window in steps; 0: 10%% of --steps, the final-loss window",
    )
    ap.add_argument("--corpus-bytes", type=int, default=4_000_000)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.lowbw", description=(__doc__ or "").splitlines()[0]
    )
    ap.add_argument("--rate", default="100mbit", help="per-host link rate (tc units)")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    add_training_options(ap)
    ap.add_argument(
        "--port",
        type=int,
        default=29620,
        help="unused, kept for old command lines: ranks now meet through a file store",
    )
    ap.add_argument("--comm-timeout", type=float, default=300.0)
    ap.add_argument("--config-timeout", type=float, default=900.0)
    ap.add_argument(
        "--schedule",
        choices=("interleaved", "sequential"),
        default="interleaved",
        help="interleaved: all configs in one pair of ranks, one step of each in turn "
        "(same background load for all); sequential: one pair of ranks per config",
    )
    ap.add_argument("--no-probe", action="store_true", help="skip the raw link probe")
    ap.add_argument("--loopback", action="store_true", help="fast-network mode only")
    ap.add_argument("--both", action="store_true", help="emulated link, then loopback")
    ap.add_argument("--loopback-configs", default=",".join((*SYNCLINE_CONFIGS, "ddp")))
    ap.add_argument(
        "--loopback-global-batch",
        type=int,
        default=0,
        help="loopback only: sequences per step (0: --global-batch, the emulated run's)",
    )
    ap.add_argument("--loopback-rounds", type=int, default=7)
    ap.add_argument("--loopback-segment", type=int, default=10)
    ap.add_argument("--out", default=str(RESULTS))
    return ap


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    s = settings(a)
    out = Path(a.out)
    if not a.loopback:
        e = _emulated(a, s)
        merge_results(out, "lowbw", {"emulated": e}, indent=1)
        report.print_emulated(e)
    if a.loopback or a.both:
        lb = _loopback(a, s)
        key = f"loopback_batch{a.loopback_global_batch}" if a.loopback_global_batch else "loopback"
        merge_results(out, "lowbw", {key: lb}, indent=1)
        report.print_loopback(lb)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit("run it from the repository root as: python -m benchmarks.lowbw")
