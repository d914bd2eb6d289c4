"""The ``syncline`` command. ``syncline train`` with no options is the main job.

Every option is validated (into a :class:`~syncline.config.TrainConfig`) before any process
starts; a bad value ends with one line naming it and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from syncline.config import (
    BACKENDS,
    DATASETS,
    INTERLEAVED_CHUNKS,
    MODELS,
    OPTIMIZERS,
    SCHEDULES,
    TrainConfig,
)
from syncline.errors import CommError, ConfigError

_D = TrainConfig()  # defaults, shown in --help

DESCRIPTION = """\
Train a reference model with syncline's data parallelism, or as a pipeline
(--pipeline-stages), launched through torchrun's elastic launcher. With no options: the GPT
byte-level language model on the Python standard library's own source code, 2 local
processes (gloo on CPU, NCCL on GPUs), about a minute or two.

Output: a progress line per logged step (loss, samples/s, tokens/s, bytes allreduced per
step), a summary, and a run directory with config.json, metrics.jsonl, loss.png,
summary.json and checkpoint.pt (written atomically, verified on load); pipelines add
trace.json (Chrome/Perfetto trace of the executed actions of every rank) and schedule.png
(their Gantt chart), both of the last steps.

Pipeline example: syncline train --pipeline-stages 2 --microbatches 8 --schedule 2bw
(the model is cut into 2 stages, one per rank; the batch into 8 micro-batches).

Multi-node: run the same command on every node with --nnodes, --node-rank and
--rdzv-endpoint HOST:PORT of node 0.
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="syncline", description="syncline: distributed training for PyTorch.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    t = sub.add_parser(
        "train",
        help="train a reference model with data or pipeline parallelism",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = t.add_argument_group("model and data")
    g.add_argument(
        "--model",
        default=_D.model,
        metavar="NAME",
        help=f"reference model: {', '.join(MODELS)} (default: %(default)s)",
    )
    g.add_argument(
        "--data",
        default=None,
        metavar="NAME",
        help="data set: "
        + "; ".join(f"{m}: {', '.join(d)}" for m, d in DATASETS.items())
        + " (default: the first)",
    )
    g.add_argument(
        "--seq-len",
        type=int,
        default=_D.seq_len,
        help="GPT context length in bytes (default: %(default)s)",
    )
    g.add_argument(
        "--n-layer",
        type=int,
        default=_D.n_layer,
        help="GPT transformer blocks (default: %(default)s)",
    )
    g.add_argument("--n-embd", type=int, default=_D.n_embd, help="GPT width (default: %(default)s)")
    g.add_argument(
        "--n-head",
        type=int,
        default=_D.n_head,
        help="GPT attention heads; must divide --n-embd (default: %(default)s)",
    )
    g.add_argument(
        "--cnn-width", type=int, default=_D.cnn_width, help="CNN channels (default: %(default)s)"
    )
    o = t.add_argument_group("optimisation")
    o.add_argument(
        "--batch-size",
        type=int,
        default=_D.batch_size,
        help="global batch over all ranks; must divide evenly (default: %(default)s)",
    )
    o.add_argument("--steps", type=int, default=300, help="optimizer steps (default: %(default)s)")
    o.add_argument(
        "--lr", type=float, default=_D.lr, help="peak learning rate (default: %(default)s)"
    )
    o.add_argument(
        "--optimizer", default=_D.optimizer, help=f"{', '.join(OPTIMIZERS)} (default: %(default)s)"
    )
    o.add_argument(
        "--momentum", type=float, default=_D.momentum, help="SGD momentum (default: %(default)s)"
    )
    o.add_argument(
        "--weight-decay",
        type=float,
        default=_D.weight_decay,
        help="decoupled weight decay (default: %(default)s)",
    )
    o.add_argument(
        "--warmup-steps",
        type=int,
        default=_D.warmup_steps,
        help="linear LR warm-up steps, then cosine decay (default: %(default)s)",
    )
    o.add_argument(
        "--seed",
        type=int,
        default=_D.seed,
        help="seed of model init and data order (default: %(default)s)",
    )
    d = t.add_argument_group("data parallelism")
    d.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=_D.bucket_cap_mb,
        help="lazy-allreduce threshold in MiB (default: measured: the engine tries a few "
        "bucket plans during the first ~50 steps and keeps the fastest; 25 with a stateful "
        "compressor)",
    )
    d.add_argument(
        "--first-bucket-cap-mb",
        type=float,
        default=None,
        help="first bucket in MiB, small so communication starts early in backward "
        "(default: 1, as DDP)",
    )
    d.add_argument(
        "--timeout",
        type=float,
        default=_D.timeout_s,
        dest="timeout_s",
        help="seconds any wait on another rank may take (default: %(default)s)",
    )
    d.add_argument(
        "--compression",
        default=_D.compression,
        metavar="SPEC",
        help="gradient compression: none, fp16, bf16, csc:DENSITY[:warmup=N]"
        "[:chunk=C][:momentum=M][:ramp=dense|exp], topk:RATIO, powersgd:RANK[:warmup=N] "
        "(default: %(default)s). With csc and sgd, momentum moves into CSC",
    )
    d.add_argument(
        "--allreduce",
        default=_D.allreduce,
        help="flat (one ring) or hierarchical (reduce-scatter in node, allreduce "
        "across nodes, allgather in node) (default: %(default)s)",
    )
    d.add_argument(
        "--ranks-per-node",
        type=int,
        default=None,
        help="node size for --allreduce hierarchical (default: torchrun's local "
        "world size); smaller values emulate several nodes on one machine",
    )
    pp = t.add_argument_group(
        "pipeline parallelism",
        "world size = pipeline stages x data-parallel replicas; this version runs one\n"
        "replica (world size == --pipeline-stages). Not yet with --compression or\n"
        "--allreduce hierarchical.",
    )
    pp.add_argument(
        "--pipeline-stages",
        type=int,
        default=_D.pipeline_stages,
        metavar="D",
        help="cut the model into D stages, one per rank; at most the model's layers "
        "(gpt: n_layer + 2) (default: %(default)s = data parallelism only)",
    )
    pp.add_argument(
        "--microbatches",
        type=int,
        default=None,
        metavar="M",
        help="micro-batches per batch; must divide the batch per replica; 2bw needs "
        "M >= D, interleaved a multiple of D (default: 2 x D)",
    )
    pp.add_argument(
        "--schedule",
        default=None,
        metavar="NAME",
        help=f"{', '.join(SCHEDULES)}: GPipe (all forwards, then all backwards), 1F1B "
        "(PipeDream-Flush), 2BW (PipeDream-2BW: no flush, two weight versions), "
        f"interleaved (Megatron, {INTERLEAVED_CHUNKS} virtual stages per rank) "
        "(default: 1f1b)",
    )
    pp.add_argument(
        "--recompute",
        action="store_true",
        default=None,
        help="keep only stage inputs and recompute each forward before its backward "
        "(less activation memory, about one more forward of compute)",
    )
    pp.add_argument(
        "--balance",
        type=_layers_per_stage,
        default=None,
        metavar="N,N,...",
        help="layers per stage (per virtual stage for interleaved), summing to the model's "
        "layers (default: profile the layers on the first micro-batch and balance their times)",
    )
    la = t.add_argument_group("launch (passed to torchrun)")
    la.add_argument(
        "--nproc-per-node",
        "--nproc",
        type=int,
        default=_D.nproc_per_node,
        help="processes on this node (default: %(default)s)",
    )
    la.add_argument(
        "--nnodes", type=int, default=_D.nnodes, help="number of nodes (default: %(default)s)"
    )
    la.add_argument(
        "--node-rank",
        type=int,
        default=_D.node_rank,
        help="this node's rank, 0..nnodes-1 (default: %(default)s)",
    )
    la.add_argument(
        "--rdzv-endpoint",
        default=None,
        metavar="HOST:PORT",
        help="node 0's address for the rendezvous (needed when --nnodes > 1)",
    )
    la.add_argument(
        "--backend",
        default=_D.backend,
        help=f"{', '.join(BACKENDS)}; auto = nccl with GPUs, else gloo (default: %(default)s)",
    )
    la.add_argument(
        "--threads",
        type=int,
        default=_D.threads,
        help="torch threads per rank (default: %(default)s)",
    )
    la.add_argument(
        "--emulate-network",
        default=None,
        metavar="RATE",
        help="run each node in its own Linux network namespace on this machine, joined by "
        "tc-tbf-limited links of RATE (e.g. 100mbit, 1gbit); without --nnodes every rank is "
        "its own node. Needs root and iproute2; everything it creates is removed afterwards",
    )
    r = t.add_argument_group("output")
    r.add_argument("--run-dir", default=None, help="run directory (default: runs/<time>-<model>)")
    r.add_argument(
        "--log-every",
        type=int,
        default=_D.log_every,
        help="print and record every N steps (default: %(default)s)",
    )
    r.add_argument(
        "--inject-failure",
        default=None,
        metavar="RANK:STEP",
        help="testing aid: make RANK exit at STEP, to see the job stop cleanly",
    )
    return parser


def _layers_per_stage(text: str) -> tuple[int, ...]:
    """``--balance 2,3`` as ``(2, 3)``; sizes are checked against the model by TrainConfig."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"balance={text!r} is not a comma-separated list of layers per stage, e.g. 2,2"
        ) from None


def _max_local_processes(backend: str) -> tuple[int, str]:
    """How many ranks one node may start, and why (GPUs, or a bound on CPU oversubscription)."""
    if backend in ("nccl", "auto"):
        try:
            import torch

            gpus = torch.cuda.device_count()
        except Exception:
            gpus = 0
        if gpus or backend == "nccl":
            return gpus, f"{gpus} visible GPU(s)"
    cores = os.cpu_count() or 1
    return 8 * cores, f"8 x {cores} CPU core(s)"


def config_from_args(ns: argparse.Namespace) -> TrainConfig:
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    values = {k: v for k, v in vars(ns).items() if k in fields and v is not None}
    if "run_dir" not in values:
        values["run_dir"] = f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{ns.model}"
    if ns.emulate_network is not None:
        _check_emulation(ns.emulate_network, values)
    limit, why = _max_local_processes(str(values.get("backend", _D.backend)))
    nproc = values.get("nproc_per_node", _D.nproc_per_node)
    if isinstance(nproc, int) and nproc > limit:
        raise ConfigError(f"nproc_per_node={nproc} is more than this node allows ({limit}: {why})")
    cfg = TrainConfig(**values)
    from syncline.dp.compressors import build_compressor

    build_compressor(cfg.compression)  # raises ConfigError on a bad spec, before any work
    return cfg


def _check_emulation(rate: str, values: dict[str, object]) -> None:
    """Validate --emulate-network and turn a single node into one emulated node per rank."""
    from syncline.launch.netns import NetworkEmulationError, check_prerequisites, parse_rate

    parse_rate(rate)
    try:
        check_prerequisites()
    except NetworkEmulationError as exc:
        raise ConfigError(f"--emulate-network {rate}: {exc}") from None
    if values.get("rdzv_endpoint"):
        raise ConfigError("--emulate-network picks the rendezvous itself; drop --rdzv-endpoint")
    if values.get("nnodes", 1) == 1:
        values["nnodes"] = values.get("nproc_per_node", _D.nproc_per_node)
        values["nproc_per_node"] = 1
    values["rdzv_endpoint"] = "emulated:0"  # replaced by host 0's address at launch


def cmd_train(ns: argparse.Namespace) -> int:
    cfg = config_from_args(ns)
    from syncline.launch.torchrun import LaunchSpec, launch

    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    config_path = run_dir / "config.json"
    config_path.write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    pipeline = (
        f", pipeline of {cfg.pipeline_stages} stages ({cfg.schedule}, "
        f"{cfg.microbatches} micro-batches{', recompute' if cfg.recompute else ''})"
        if cfg.pipelined
        else ""
    )
    print(
        f"syncline train: {cfg.model} on {cfg.dataset}, {cfg.world_size} rank(s){pipeline}, "
        f"global batch {cfg.batch_size}, {cfg.steps} steps -> {run_dir}",
        flush=True,
    )
    spec = LaunchSpec(
        module="syncline.train.worker",
        args=(str(config_path),),
        nproc_per_node=cfg.nproc_per_node,
        nnodes=cfg.nnodes,
        node_rank=cfg.node_rank,
        rdzv_endpoint=cfg.rdzv_endpoint,
        threads_per_rank=cfg.threads,
        log_dir=str(run_dir / "logs"),
    )
    if cfg.emulate_network:
        from syncline.launch.emulated import launch_emulated

        print(
            f"emulated network: {cfg.nnodes} nodes joined by {cfg.emulate_network} links",
            flush=True,
        )
        launch_emulated(spec, cfg.emulate_network, run_dir / "logs")
    else:
        launch(spec)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.command is None:
        parser.print_help()
        return 2
    try:
        return cmd_train(ns)
    except ConfigError as exc:
        print(f"syncline {ns.command}: error: {exc}", file=sys.stderr)
        return 2
    except (CommError, RuntimeError) as exc:  # LaunchError, NetworkEmulationError, ...
        print(f"syncline {ns.command}: job failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"syncline {ns.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
