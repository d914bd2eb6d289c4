"""The ``syncline`` command. ``syncline train`` with no options is the main job.

Every option is validated (into a :class:`~syncline.train.config.TrainConfig`, from whose
fields the options are generated) before any process starts; a bad value ends with one line
naming it and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from syncline.cli.cluster import apply_placement, train_here
from syncline.cli.options import add_config_options, values_from
from syncline.cli.plan import add_plan_options, cmd_plan, plan_doc
from syncline.cli.report import REPORT_DOC, add_report_options, cmd_report
from syncline.errors import CommError, ConfigError
from syncline.extras import installed, missing_line
from syncline.fields import flatten
from syncline.launch import clusters, devices
from syncline.launch.devices import default_nproc_per_node, refuse_emulated_nccl, resolved_backend
from syncline.registry import import_plugins
from syncline.train.config import TrainConfig

if TYPE_CHECKING:
    from syncline.train.snapshots import Snapshot

_D = TrainConfig()  # defaults, shown in --help
_FLAT_D = _D.to_flat_dict()

DESCRIPTION = """\
Train a registered model with syncline's data parallelism, or as a pipeline
(--pipeline-stages), launched through torchrun's elastic launcher. With no options: the GPT
byte-level language model on the Python standard library's own source code, one local
process per GPU with NCCL (each on cuda:LOCAL_RANK % GPUs), or 2 on the CPU with gloo, about
a minute or two.

Output: a progress line per logged step (loss, samples/s, tokens/s, bytes allreduced per
step, ETA; redrawn in place on a terminal), a summary, and a run directory with
config.json, metrics.jsonl, loss.png, summary.json and checkpoint.pt (written atomically,
verified on load); pipelines add trace.json (Chrome/Perfetto trace of the executed actions
of every rank) and schedule.png (their Gantt chart), both of the last steps; a language
model adds sample.txt (--sample-tokens), --tensorboard adds tensorboard/. Compare run
directories with: syncline report RUN_DIR RUN_DIR.

Pipeline example: syncline train --pipeline-stages 2 --microbatches 8 --schedule 2bw
(the model is cut into 2 stages, one per rank; the batch into 8 micro-batches).

Multi-node: run the same command on every node with --nnodes, --node-rank and
--rdzv-endpoint HOST:PORT of node 0; under Slurm (one srun task per node) and in a Kubeflow
PyTorchJob's pods they are read from the environment (flags given as well must agree).
Started by torchrun itself, it trains in torchrun's workers instead of launching again.
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``syncline`` parser; ``train``'s options are generated from ``TrainConfig``."""
    parser = _Parser(prog="syncline", description="syncline: distributed training for PyTorch.")
    parser.add_argument("--version", action="version", version=version_line())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    t = sub.add_parser(
        "train",
        help="train a registered model with data or pipeline parallelism",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_options(t)
    t.add_argument(
        "--plan",
        choices=("auto",),
        default=None,
        help="auto: profile this machine (or read --plan-cluster), run the planner and train "
        "its best configuration; the prediction is recorded in summary.json",
    )
    t.add_argument(
        "--plan-cluster",
        default=None,
        metavar="FILE",
        help="with --plan auto: a profile (syncline plan --profile) to plan from, "
        "instead of profiling now",
    )
    p = sub.add_parser(
        "plan",
        help="predict and rank data-parallel and pipeline configurations for a model",
        description=plan_doc(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_options(p)
    add_plan_options(p)
    r = sub.add_parser(
        "report",
        help="compare run directories: a table and one PNG of the runs side by side",
        description=REPORT_DOC,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_report_options(r)
    return parser


def version_line() -> str:
    """``syncline X (torch Y, Python Z)``: the installed torch is read from its metadata,
    not imported, so ``--version`` answers at once."""
    from importlib import import_module
    from importlib.metadata import PackageNotFoundError, version

    ours = import_module("syncline").__version__  # the facade, loaded before this module
    try:
        torch = version("torch")
    except PackageNotFoundError:
        torch = "not installed"
    python = ".".join(map(str, sys.version_info[:3]))
    return f"syncline {ours} (torch {torch}, Python {python})"


def _plugins_in(argv: Sequence[str]) -> list[str]:
    """The ``--plugin MODULE`` values, read before the parser is built (a plug-in's models,
    schedules and compressors then appear in ``--help`` and pass the checks)."""
    found = []
    for i, arg in enumerate(argv):
        if arg == "--plugin" and i + 1 < len(argv):
            found.append(argv[i + 1])
        elif arg.startswith("--plugin="):
            found.append(arg.split("=", 1)[1])
    return found


def _max_local_processes(backend: str, gpus: int) -> tuple[int, str]:
    """How many ranks one node may start, and why (GPUs, or a bound on CPU oversubscription)."""
    if resolved_backend(backend, gpus) == "nccl":
        return gpus, f"{gpus} visible GPU(s)"
    cores = os.cpu_count() or 1
    return 8 * cores, f"8 x {cores} CPU core(s)"


def config_from_args(ns: argparse.Namespace, *, planning: bool = False) -> TrainConfig:
    """The validated config of a parsed ``syncline train`` command line (``planning``:
    of ``syncline plan``, whose ``--ranks-per-node`` describes the planned cluster, not the
    profiled ranks).

    Raises:
        ConfigError: naming the bad value, before any process starts.
    """
    values = values_from(ns)
    gpus, backend = devices.visible_gpus(), str(values.get("backend", _D.backend))
    model = values.get("model", _D.model)
    if planning:
        values.pop("ranks_per_node", None)
    else:  # the cluster's word on nodes, node rank, rendezvous (a plan describes any cluster)
        placement = clusters.detect()
        if placement is not None:
            apply_placement(values, placement, backend, gpus, str(model))
    if values.get("resume") is not None:
        values = _resumed_values(values)
    if "run_dir" not in values:
        values["run_dir"] = f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{model}"
    if values.get("emulate_network") is not None:
        _check_emulation(values["emulate_network"], values, backend, gpus)
    values.setdefault("nproc_per_node", default_nproc_per_node(backend, gpus))
    if values.get("tensorboard") and not planning:
        from syncline.train.tensorboard_log import check_available

        check_available()
    limit, why = _max_local_processes(backend, gpus)
    nproc = values["nproc_per_node"]
    if isinstance(nproc, int) and nproc > limit:
        raise ConfigError(f"nproc_per_node={nproc} is more than this node allows ({limit}: {why})")
    from syncline.train.preflight import check_run

    return check_run(TrainConfig.from_flat(**values))  # compressor ranges, files, factories


# what a resumed run may set again: the length of the run, how it is launched and logged,
# and its shape (a checkpoint is keyed by the model's parameter names, so it reshards onto
# another pipeline or none; the continuation is then exact up to float reassociation)
_MAY_CHANGE_ON_RESUME = frozenset(
    {
        "steps",
        "pipeline_stages",
        "nproc_per_node",
        "nnodes",
        "schedule",
        "microbatches",
        "balance",
        "split_points",
        "recompute",
        "allreduce",
        "ranks_per_node",
        "resume",
        "max_restarts",
        "log_every",
        "eval_every",
        "eval_batches",
        "timeout_s",
        "threads",
        "rdzv_endpoint",
        "node_rank",
        "checkpoint_every",
        "keep_checkpoints",
        "on_checkpoint_error",
        "inject_failure",
        "plugins",
        "tensorboard",
        "sample_tokens",
    }
)


def _resumed_values(given: dict[str, object]) -> dict[str, object]:
    """``--resume RUN_DIR``: the run's own config.json, with the values that may change.

    Raises:
        ConfigError: no config.json or no complete checkpoint there, or a given option that
            differs from the run's (naming it and what may change).
    """
    run = Path(str(given["resume"]))
    path = run / "config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"resume={str(run)!r}: cannot read {path} ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"resume={str(run)!r}: {path} is not a JSON object")
    stored = flatten(TrainConfig, data)  # the parts nested, or the flat form of older runs
    for key, value in given.items():
        if key in _MAY_CHANGE_ON_RESUME:
            continue
        if key == "run_dir" and Path(str(value)).resolve() == run.resolve():
            continue  # the run continues where it lies, also after the directory moved
        mine = TrainConfig.from_flat(**{**stored, key: value}).to_flat_dict()[key]
        if mine != stored.get(key):
            raise ConfigError(
                f"resume={str(run)!r}: {key}={value!r} differs from the run's "
                f"{stored.get(key)!r}; a resumed run keeps its config (may change: "
                f"{', '.join(sorted(_MAY_CHANGE_ON_RESUME - {'resume'}))})"
            )
    latest = _newest_intact(run)
    if latest is None:
        raise ConfigError(
            f"resume={str(run)!r}: no complete checkpoint under {run / 'checkpoints'}; "
            "nothing to resume (checkpoints are written every --checkpoint-every steps)"
        )
    merged = {**stored, "inject_failure": None, **given, "run_dir": str(run), "resume": str(run)}
    steps = merged.get("steps")
    if isinstance(steps, int) and steps <= latest.step:
        raise ConfigError(
            f"resume={str(run)!r}: its newest checkpoint is of step {latest.step}, and "
            f"steps={steps} leaves nothing to train; valid: --steps greater than "
            f"{latest.step} (to extend the run)"
        )
    if merged.get("pipeline_stages", 1) == 1:  # resharded onto data parallelism
        for key in ("schedule", "microbatches", "balance", "recompute", "split_points"):
            if key not in given:
                merged[key] = _FLAT_D[key]
    elif "pipeline_stages" in given and "balance" not in given:
        merged["balance"] = None  # the old split does not fit the new number of stages
    return merged


def _newest_intact(run: Path) -> Snapshot | None:
    """The newest checkpoint of ``run`` that verifies, checked before any process starts;
    one line for each newer one skipped, and why.

    Raises:
        ConfigError: there are checkpoints, but every one is damaged.
    """
    from syncline.train.snapshots import SnapshotStore, problems

    skipped = []
    for snap in reversed(SnapshotStore(run / "checkpoints", keep=1).complete()):
        found = problems(snap.path)
        if not found:
            return snap
        skipped.append(f"{snap.path.name}: damaged: {found[0]}")
        print(f"syncline train: skipping checkpoint {snap.path}: damaged: {found[0]}", flush=True)
    if skipped:
        raise ConfigError(
            f"resume={str(run)!r}: no intact checkpoint to resume from ({'; '.join(skipped)})"
        )
    return None


def _check_emulation(rate: str, values: dict[str, object], backend: str, gpus: int) -> None:
    """Validate --emulate-network and turn a single node into one emulated node per rank
    (``--nproc-per-node`` ranks, default 2: the ranks are CPU ranks under gloo)."""
    from syncline.launch.netns import NetworkEmulationError, check_prerequisites, parse_rate

    if resolved_backend(backend, gpus) == "nccl":  # before anything needs root
        refuse_emulated_nccl(rate, "given" if backend == "nccl" else f"auto: {gpus} GPU(s)")
    parse_rate(rate)
    try:
        check_prerequisites()
    except NetworkEmulationError as exc:
        raise ConfigError(f"--emulate-network {rate}: {exc}") from None
    if values.get("rdzv_endpoint"):
        raise ConfigError("--emulate-network picks the rendezvous itself; drop --rdzv-endpoint")
    if values.get("nnodes", 1) == 1:
        values["nnodes"] = values.get("nproc_per_node", default_nproc_per_node(backend, gpus))
        values["nproc_per_node"] = 1
    values["rdzv_endpoint"] = "emulated:0"  # replaced by host 0's address at launch


def cmd_train(ns: argparse.Namespace) -> int:
    """Validate, lock the run directory for the job's lifetime (a second job on it is
    refused), prepare it and launch; started by torchrun, train in this process instead.

    Node 0 holds the lock (the launcher, or rank 0 under torchrun): the other nodes of a
    multi-node job share the run directory with it.
    """
    from syncline.launch.lifeline import lock_run_dir

    placement = clusters.detect()
    here = placement is not None and placement.source == "torchrun"
    if here and placement is not None and placement.rank != 0:
        return train_here(config_from_args(ns), placement)  # rank 0 alone speaks and locks
    node = placement.node_rank if placement is not None else getattr(ns, "node_rank", None)
    given = Path(str(getattr(ns, "resume", None) or getattr(ns, "run_dir", None) or ""))
    with contextlib.ExitStack() as held:
        lock = None
        if not node and str(given) != "." and given.is_dir():  # before its checkpoints are read
            lock = held.enter_context(lock_run_dir(given))
        cfg = config_from_args(ns)
        if cfg.node_rank == 0 and (lock is None or given.resolve() != Path(cfg.run_dir).resolve()):
            lock = held.enter_context(lock_run_dir(cfg.run_dir))
        if lock is not None:
            lock.announce()
        return _launch_train(cfg, placement)


def _launch_train(cfg: TrainConfig, placement: clusters.Placement | None) -> int:
    here = placement is not None and placement.source == "torchrun"
    from syncline.launch.torchrun import LaunchSpec, launch
    from syncline.train.preflight import prepare_node

    run_dir = Path(cfg.run_dir)
    config_path, log_dir = (run_dir / "config.json", run_dir / "logs")
    if not here:
        config_path, log_dir = prepare_node(cfg)
    p, optim = cfg.pipeline, cfg.optim
    pipeline = (
        f", pipeline of {p.pipeline_stages} stages ({p.schedule}, "
        f"{p.microbatches} micro-batches{', recompute' if p.recompute else ''})"
        if p.pipelined
        else ""
    )
    print(
        f"syncline train: {cfg.model} on {cfg.dataset}, {cfg.world_size} rank(s){pipeline}, "
        f"global batch {cfg.batch_size}, {cfg.steps} steps -> {run_dir}\n"
        f"optimizer {optim.optimizer}, peak learning rate {cfg.peak_lr:.6g}"
        + (
            f" (lr {optim.lr:g} x {optim.lr_scaling} scaling from batch "
            f"{optim.base_batch_size} to {cfg.batch_size})"
            if optim.lr_scaling != "none" and optim.base_batch_size not in (None, cfg.batch_size)
            else ""
        )
        + f", warm-up {optim.warmup_steps} steps",
        flush=True,
    )
    if not installed("matplotlib"):  # the run goes on: metrics.jsonl holds every value
        print(f"syncline train: no plots: {missing_line('loss.png', 'matplotlib')}", flush=True)
    if placement is not None:
        where = ", ".join(placement.origin.values())
        print(f"syncline train: node {cfg.node_rank} of {cfg.nnodes} ({placement.source}: "
              f"{where})" + ("; started by torchrun: training in this process" if here else ""),
              flush=True)  # fmt: skip
    if here and placement is not None:
        return train_here(cfg, placement)
    spec = LaunchSpec(
        module="syncline.train.worker",
        args=(str(config_path),),
        nproc_per_node=cfg.nproc_per_node,
        nnodes=cfg.nnodes,
        node_rank=cfg.node_rank,
        rdzv_endpoint=cfg.rdzv_endpoint,
        threads_per_rank=cfg.threads,
        log_dir=str(log_dir),
        max_restarts=cfg.checkpoint.max_restarts,
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


def _refuse_planning_under_torchrun() -> None:
    """``--plan auto`` profiles this machine and launches the chosen configuration itself,
    which a worker torchrun started cannot do without launching twice."""
    placement = clusters.detect()
    if placement is not None and placement.source == "torchrun":
        raise ConfigError(
            "--plan auto profiles and launches by itself; run it outside torchrun, or train "
            "a planned configuration under torchrun (syncline plan prints its options)"
        )


def cmd_train_planned(argv: list[str], ns: argparse.Namespace) -> int:
    """``syncline train --plan auto``: plan, then train the best configuration that fits,
    and record the prediction beside the measurement in ``summary.json``."""
    from syncline.cli.plan import plan
    from syncline.train.runs import peak_memory

    cfg = config_from_args(ns, planning=True)
    planner_ns = argparse.Namespace(
        profile=ns.plan_cluster is None,
        profile_out=str(Path(cfg.run_dir) / "plan" / "profile.json"),
        cluster=ns.plan_cluster,
        costs=None,
        ranks=cfg.world_size,
        memory_per_rank=None,
        top=5,
    )
    document, text = plan(cfg, planner_ns)
    print(text, flush=True)
    best = next((c for c in document["candidates"] if c["fits"]), None)
    if best is None:
        raise ConfigError("--plan auto: no configuration fits in memory (see the table)")
    given = [a for a in argv if a not in ("--plan", "auto") and not a.startswith("--plan=")]
    chosen = build_parser().parse_args([*given, *best["train_args"], f"--run-dir={cfg.run_dir}"])
    chosen.plan = None
    print(f"--plan auto: training {best['label']} ({' '.join(best['train_args'])})", flush=True)
    code = cmd_train(chosen)
    summary_path = Path(cfg.run_dir) / "summary.json"
    if code == 0 and summary_path.is_file():
        summary = json.loads(summary_path.read_text())
        measured = summary.get("median_samples_per_s")
        peaks, kind = peak_memory(summary)
        summary["plan"] = {
            "chosen": best["label"],
            "train_args": best["train_args"],
            "predicted_step_s": best["predicted_step_s"],
            "predicted_samples_per_s": best["predicted_samples_per_s"],
            "predicted_peak_bytes": best["predicted_peak_bytes"],
            "measured_step_s": (cfg.batch_size / measured) if measured else None,
            "measured_peak_bytes": max(peaks or [0]) or None,
            "measured_peak_kind": kind,
        }
        summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    return code


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    plugins = _plugins_in(args)
    # --model/--data package.module:factory, given or in the config --resume reads
    factories = any(":" in a or a.startswith("--resume") for a in args)
    if (plugins or factories) and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as in the ranks, which torchrun starts with `-m`
    try:
        import_plugins(plugins)
    except ConfigError as exc:
        print(f"syncline: error: {exc}", file=sys.stderr)
        return 2
    parser = build_parser()
    ns = parser.parse_args(args)
    if ns.command is None:
        parser.print_help()
        return 2
    try:
        if ns.command == "report":
            return cmd_report(ns)
        if ns.command == "plan":
            return cmd_plan(config_from_args(ns, planning=True), ns)
        if ns.plan == "auto":
            _refuse_planning_under_torchrun()
            return cmd_train_planned(args, ns)
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
