"""syncline pipelines vs torch.distributed.pipelining: same GPT, stages, micro-batches, data.

By default (``--processes separate``) each engine runs in processes of its own, as a user
runs it: every engine's ranks (``syncline.testing.run_ranks``, gloo, one process per stage)
start at once, warm up, and then take turns (:mod:`syncline.testing.turns`): per turn, each
engine times one segment of ``--steps`` steps while the others sleep, the order reversing
every turn; reported are the median samples/s per engine and, for each ratio, the median
of the per-turn ratios (``--pairs`` turns).

The engines: torch's ``PipelineStage`` with ``ScheduleGPipe`` and ``Schedule1F1B``, and
syncline's ``Pipeline`` with ``gpipe``, ``1f1b`` and ``2bw``, all with default settings.
Segments of several steps, not single steps, are timed, because 2BW's gain is that a step
starts the next batch before the last one ends, which a barrier between steps would undo.
Each engine's first loss is reported too (all must agree: same weights, same batch).

With ``--processes shared``, one run trains a copy of the model with each engine in
alternating segments in the same processes (the order reverses every pair, so drift
favours none; two copies of each engine, built in opposite orders, take turns; each engine
has its own process group); the ratios are of medians and medians of the per-segment
ratios, and separate untimed pipelines with ``track_memory=True`` (saved-tensor hooks,
which cost time) report syncline's measured per-stage memory.

    python -m benchmarks.pipeline_vs_torch --pairs 5 --steps 10 --micro 8 \\
        --out benchmarks/results/pipeline_vs_torch.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from syncline import comm
from syncline.data import ByteDataset, stdlib_corpus
from syncline.models import build_model, lm_loss
from syncline.partition import stage_bounds
from syncline.pipeline import Pipeline
from syncline.testing import run_ranks
from syncline.testing.bench import abba, paired_ratios, ratio_of_medians, write_json
from syncline.testing.turns import Baton, run_in_turns

ENGINES = ("torch-gpipe", "torch-1f1b", "syncline-gpipe", "syncline-1f1b", "syncline-2bw")
RATIOS = {
    "syncline_1f1b_over_torch_1f1b": ("syncline-1f1b", "torch-1f1b"),
    "syncline_gpipe_over_torch_gpipe": ("syncline-gpipe", "torch-gpipe"),
    "syncline_2bw_over_syncline_1f1b": ("syncline-2bw", "syncline-1f1b"),
}


def _model(args: argparse.Namespace) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return build_model(
        "gpt", n_layer=args.layers, n_embd=args.embd, n_head=args.heads, block_size=args.seq
    )


def _batches(args: argparse.Namespace, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = ByteDataset(stdlib_corpus(400_000), args.seq)
    g = torch.Generator().manual_seed(1)
    return [data.get(torch.randint(0, len(data), (args.batch,), generator=g)) for _ in range(count)]


class _TorchEngine:
    """One stage under torch.distributed.pipelining, stepped like syncline's train_step."""

    def __init__(self, kind: str, rank: int, world: int, args: argparse.Namespace, group) -> None:
        lo, hi = stage_bounds(args.balance)[rank]
        part = torch.nn.Sequential(*list(_model(args))[lo:hi])
        stage = PipelineStage(part, rank, world, torch.device("cpu"), group=group)
        cls = ScheduleGPipe if kind == "gpipe" else Schedule1F1B
        self.schedule = cls(stage, args.micro, loss_fn=lm_loss)
        self.opt = torch.optim.SGD(part.parameters(), lr=args.lr, momentum=0.9)
        self.rank, self.last = rank, rank == world - 1

    def train_step(self, batches) -> float:
        x, y = next(batches)
        losses: list[torch.Tensor] = []
        if self.rank == 0:
            self.schedule.step(x)
        elif self.last:
            self.schedule.step(target=y, losses=losses)
        else:
            self.schedule.step()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(torch.stack(losses).detach().mean()) if losses else float("nan")


def _engine(name: str, rank: int, world: int, args: argparse.Namespace):
    """Each engine gets its own process group, so their messages can never mix."""
    group = dist.new_group(list(range(world)))
    lib, kind, *rest = name.split("-")
    if lib == "torch":
        return _TorchEngine(kind, rank, world, args, group)
    return Pipeline(
        _model(args),
        num_stages=world,
        num_microbatches=args.micro,
        schedule=kind,
        loss_fn=lm_loss,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=args.lr, momentum=0.9),
        balance=args.balance,
        process_group=group,
        timeout_s=120,
        track_memory="tracked" in rest,
    )


def _rank(rank: int, world: int, args: argparse.Namespace) -> dict:
    total = (args.pairs + 1) * args.steps + 2
    # Two copies of each engine, the second set built in reverse order: where an engine's
    # memory lands moves its step time by a few per cent (see dp_vs_ddp), and building every
    # syncline engine after every torch one would hand that to one side. Each pair runs every
    # engine twice, once per copy.
    builds = [(n, copy) for copy in (0, 1) for n in abba(ENGINES, copy)]
    engines = {key: _engine(key[0], rank, world, args) for key in builds}
    data = _batches(args, total)
    streams = {key: iter(data) for key in builds}
    first = {n: engines[(n, 0)].train_step(streams[(n, 0)]) for n in ENGINES}
    engines_by_build = [(key, engines[key]) for key in builds]
    for key, e in engines_by_build[len(ENGINES) :]:
        e.train_step(streams[key])
    for _ in range(args.steps - 1):  # warm-up
        for key, e in engines_by_build:
            e.train_step(streams[key])
    seconds: dict[str, list[float]] = {n: [] for n in ENGINES}
    for pair in range(args.pairs):
        for copy in (0, 1):
            for n in abba(ENGINES, pair):
                engine, stream = engines[(n, copy)], streams[(n, copy)]
                comm.barrier(what=f"{n} segment start")
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    engine.train_step(stream)
                comm.barrier(what=f"{n} segment end")
                seconds[n].append(time.perf_counter() - t0)
    memory = {}
    for n in ENGINES:
        if n.startswith("syncline"):
            tracked = _engine(n + "-tracked", rank, world, args)
            stream = iter(_batches(args, 4))
            for _ in range(3):
                tracked.train_step(stream)
            tracked.flush()
            memory[n] = {s: asdict(v) for s, v in tracked.memory_stats().items()}
    return {"seconds": seconds, "first_loss": first, "memory": memory}


def _alone(rank: int, world: int, name: str, baton: Baton, args: argparse.Namespace) -> dict:
    """One engine in processes of its own: warm-up, then one timed segment per turn."""
    engine = _engine(name, rank, world, args)
    stream = iter(_batches(args, (args.pairs + 1) * args.steps + 2))
    first = engine.train_step(stream)
    for _ in range(args.steps - 1):  # warm-up
        engine.train_step(stream)
    seconds = []
    for _ in baton.turns(name, rank):
        comm.barrier(what=f"{name} segment start")
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.train_step(stream)
        comm.barrier(what=f"{name} segment end")
        seconds.append(time.perf_counter() - t0)
    return {"seconds": seconds, "first_loss": first}


def _separate(args: argparse.Namespace) -> dict:
    """Each engine in its own processes, as a user runs it, all started at once and taking
    turns (:mod:`syncline.testing.turns`): one segment each per turn, ABBA order."""
    results = run_in_turns(
        _alone, ENGINES, world=args.ranks, turns=args.pairs, args=(args,), timeout_s=3600
    )
    samples = args.steps * args.batch
    per_turn = {
        n: [samples / max(r["seconds"][i] for r in results[n]) for i in range(args.pairs)]
        for n in ENGINES
    }
    return {
        "samples_per_s": {n: statistics.median(v) for n, v in per_turn.items()},
        "per_turn_samples_per_s": per_turn,
        "ratios": {k: ratio_of_medians(per_turn[a], per_turn[b]) for k, (a, b) in RATIOS.items()},
        "median_turn_ratios": {
            k: statistics.median(paired_ratios(per_turn[a], per_turn[b]))
            for k, (a, b) in RATIOS.items()
        },
        "first_loss": {n: results[n][-1]["first_loss"] for n in ENGINES},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.pipeline_vs_torch", description=(__doc__ or "").splitlines()[0]
    )
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--layers", type=int, default=4, help="transformer blocks")
    p.add_argument("--embd", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--steps", type=int, default=10, help="steps per timed segment")
    p.add_argument("--pairs", type=int, default=3, help="ABBA pairs of segments")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument(
        "--processes",
        choices=("separate", "shared"),
        default="separate",
        help="separate: each engine in its own processes, rounds taking turns (as a user "
        "runs them); shared: every engine in the same processes, segments taking turns",
    )
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    layers = args.layers + 2  # embedding, blocks, head
    per = [layers // args.ranks + (1 if r < layers % args.ranks else 0) for r in range(args.ranks)]
    args.balance = per
    if args.processes == "separate":
        report = {"config": {k: v for k, v in vars(args).items() if k != "out"}}
        report.update(_separate(args))
        if args.out is not None:
            write_json(args.out, report, indent=2)
        print(json.dumps(report, indent=2, default=str))
        return 0
    results = run_ranks(_rank, args.ranks, args, timeout_s=3600)
    samples = args.steps * args.batch
    per_segment = {
        n: [
            samples / max(r["seconds"][n][i] for r in results)
            for i in range(len(results[0]["seconds"][n]))
        ]
        for n in ENGINES
    }
    rates = {n: statistics.median(v) for n, v in per_segment.items()}
    last = results[-1]
    report = {
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "samples_per_s": rates,
        "ratios": {
            k: ratio_of_medians(per_segment[a], per_segment[b]) for k, (a, b) in RATIOS.items()
        },
        "median_segment_ratios": {
            k: statistics.median(paired_ratios(per_segment[a], per_segment[b]))
            for k, (a, b) in RATIOS.items()
        },
        "first_loss": last["first_loss"],
        "memory": {
            n: {s: m for r in results for s, m in r["memory"][n].items()}
            for n in results[0]["memory"]
        },
    }
    if args.out is not None:
        write_json(args.out, report, indent=2)
    print(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit("run it from the repository root as: python -m benchmarks.pipeline_vs_torch")
