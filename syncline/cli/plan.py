"""``syncline plan``: predict and rank the ways to train a model on N ranks.

The model options are ``syncline train``'s (the same flags, generated from ``TrainConfig``);
the planner's own say where the costs come from and how big the cluster is::

    syncline plan --profile                          measure this machine, then plan for it
    syncline plan --profile --emulate-network 100mbit  ... over emulated 100 Mbit/s links
    syncline plan --cluster v100.json --ranks 64     plan a described cluster
    syncline plan ... --json                         {"candidates": [...]}, best first

Each candidate's ``train_args`` run exactly that configuration when appended to the model
options (``syncline train --plan auto`` does it for the best one).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from syncline.errors import ConfigError
from syncline.fields import check_int
from syncline.launch import devices
from syncline.launch.devices import device_kind, resolved_backend

if TYPE_CHECKING:
    from syncline.train.config import TrainConfig


def plan_doc() -> str:
    """``syncline plan --help``'s description: this module's docstring."""
    return __doc__ or ""


def add_plan_options(parser: argparse.ArgumentParser) -> None:
    """The planner's own flags (the model options come from ``add_config_options``)."""
    g = parser.add_argument_group("planner")
    g.add_argument(
        "--ranks",
        type=int,
        default=None,
        metavar="N",
        help="ranks to plan for (default: the profiled ranks, --nproc-per-node x --nnodes)",
    )
    g.add_argument(
        "--memory-per-rank",
        default=None,
        metavar="SIZE",
        help="memory one rank may hold, e.g. 16GiB (default: the cluster's)",
    )
    g.add_argument(
        "--cluster",
        default=None,
        metavar="FILE",
        help="a cluster description (JSON, or a profile written by --profile)",
    )
    g.add_argument(
        "--costs",
        default=None,
        metavar="FILE",
        help="model costs (JSON, or a profile); default: the profile's, or computed "
        "from the GPT's shape when the cluster gives flops_per_s",
    )
    g.add_argument("--top", type=int, default=15, metavar="K", help="rows to print (default 15)")
    g.add_argument("--json", action="store_true", help='print {"candidates": [...]} instead')
    g.add_argument(
        "--profile",
        action="store_true",
        help="measure this machine's costs first (ranks from --nproc-per-node)",
    )
    g.add_argument(
        "--profile-out",
        default="runs/plan/profile.json",
        metavar="FILE",
        help="where --profile writes (default runs/plan/profile.json)",
    )


def _model_args(cfg: TrainConfig) -> list[str]:
    """The ``syncline train`` options that select ``cfg``'s model, data and optimizer."""
    args = [f"--model={cfg.model}", f"--seq-len={cfg.seq_len}"]
    if cfg.data is not None:
        args.append(f"--data={cfg.data}")
    args += [f"--model-option={k}={v}" for k, v in sorted(cfg.model_options.items())]
    return args


def run_profile(cfg: TrainConfig, out: Path) -> Path:
    """Launch the profile ranks (``syncline.train.plan_profile``) through torchrun."""
    from syncline.launch.torchrun import LaunchSpec, launch

    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="syncline-plan-") as tmp:
        config = Path(tmp) / "config.json"
        config.write_text(json.dumps(cfg.to_dict()))
        spec = LaunchSpec(
            module="syncline.train.plan_profile",
            args=(str(config), str(out.resolve()), "1" if cfg.emulate_network else "0"),
            nproc_per_node=cfg.nproc_per_node,
            nnodes=cfg.nnodes,
            node_rank=cfg.node_rank,
            rdzv_endpoint=cfg.rdzv_endpoint,
            threads_per_rank=cfg.threads,
            log_dir=str(Path(tmp) / "logs"),
        )
        backend = resolved_backend(cfg.backend, devices.visible_gpus())
        print(
            f"syncline plan: profiling {cfg.model} on {cfg.world_size} rank(s) "
            f"({device_kind(backend)}, {backend})"
            + (f" over emulated {cfg.emulate_network} links" if cfg.emulate_network else ""),
            file=sys.stderr,
            flush=True,
        )
        if cfg.emulate_network:
            from syncline.launch.emulated import launch_emulated

            launch_emulated(spec, cfg.emulate_network, Path(tmp) / "logs")
        else:
            launch(spec)
    print(profile_memory_line(json.loads(out.read_text())), file=sys.stderr, flush=True)
    return out


def profile_memory_line(profile: dict[str, Any]) -> str:
    """What ``plan --profile`` says of the memory it measured: each rank's peak over two
    training steps, on the device it profiled (a profile of an earlier version: nothing).

    Example:
        >>> profile_memory_line({"measured": {"device": "cuda", "backend": "nccl",
        ...     "peak_memory_kind": "cuda_max_allocated",
        ...     "peak_memory_bytes_per_rank": [3 << 30, 3 << 30]}})[24:]
        'on cuda (nccl): peak memory per rank 3.00, 3.00 GiB (cuda_max_allocated)'
    """
    measured = profile.get("measured", {})
    peaks = measured.get("peak_memory_bytes_per_rank")
    if not peaks:
        return "syncline plan: the profile records no peak memory"
    shown = ", ".join(f"{p / 2**30:.2f}" for p in peaks)
    return (
        f"syncline plan: profiled on {measured.get('device')} ({measured.get('backend')}): "
        f"peak memory per rank {shown} GiB ({measured.get('peak_memory_kind')})"
    )


def _costs_for(cfg: TrainConfig, ns: argparse.Namespace, cluster: Any, profile: Path | None) -> Any:
    from syncline.planner import ModelCosts, transformer_costs

    source = ns.costs or (str(profile) if profile else None) or ns.cluster
    if source is not None:
        try:
            return ModelCosts.load(source)
        except ConfigError:
            if ns.costs:
                raise
    if cfg.model == "gpt" and (cluster.flops_per_s or cluster.device is not None):
        c = cfg.model_config()
        return transformer_costs(
            n_layer=c.n_layer,
            n_embd=c.n_embd,
            n_head=c.n_head,
            seq_len=c.block_size,
            vocab_size=c.vocab_size,
            flops_per_s=cluster.flops_per_s,
            device=cluster.device,
            activation_bytes_per_value=4,
            param_bytes=4,
            name="gpt",
        )
    raise ConfigError(
        "no model costs: give --profile (measure them here), --costs FILE, or a --cluster "
        "with flops_per_s or a device for the gpt model's shape"
    )


def plan(cfg: TrainConfig, ns: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """Run the planner for ``cfg``'s model; returns the JSON document and the table text."""
    from syncline.planner import Cluster, SearchSpace, parse_size, search, table, to_json

    # Everything the user typed is checked before a rank is launched.
    ranks = ns.ranks if ns.ranks is not None else cfg.world_size
    check_int("--ranks", ranks)
    memory = None
    if ns.memory_per_rank is not None:
        memory = parse_size(ns.memory_per_rank, "--memory-per-rank")
    check_int("--top", ns.top)
    if not ns.profile and ns.cluster is None:
        raise ConfigError("no cluster: give --profile (measure this machine) or --cluster FILE")
    for flag, path in (("--cluster", ns.cluster), ("--costs", ns.costs)):
        if path is not None and not Path(path).is_file():
            raise ConfigError(f"{flag}={path}: no such file; valid: a JSON description")
    profile = run_profile(cfg, Path(ns.profile_out)) if ns.profile else None
    source = ns.cluster or str(profile)
    cluster = Cluster.load(source).with_ranks_per_node(getattr(ns, "ranks_per_node", None))
    if memory is not None:
        cluster = cluster.with_memory(memory)
    costs = _costs_for(cfg, ns, cluster, profile)
    syncs = tuple(dict.fromkeys(("every-step", cfg.dp.sync)))  # and --sync's, if periodic
    space = SearchSpace(
        ranks=ranks, batch_size=cfg.batch_size, optimizer=cfg.optim.optimizer, syncs=syncs
    )
    found = search(space, costs, cluster)
    extra = [f"--emulate-network={cfg.emulate_network}"] if cfg.emulate_network else []
    document = to_json(found, cluster, _model_args(cfg))
    for row in document["candidates"]:
        if extra:  # emulated nodes are made from --nproc-per-node ranks by the launcher
            launch = ("--nproc-per-node", "--nnodes")
            kept = [a for a in row["train_args"] if not a.startswith(launch)]
            row["train_args"] = [f"--nproc-per-node={ranks}", *kept, *extra]
        row["train_args"].append(f"--threads={cfg.threads}")
    title = (
        f"syncline plan: {costs.name} ({costs.params / 1e6:.2f}M parameters, "
        f"{costs.num_layers} layers), {ranks} ranks of {cluster.name} "
        f"({cluster.ranks_per_node} per node), global batch {cfg.batch_size}; "
        f"{len(found)} configurations, {sum(p.fits for p in found)} fit"
    )
    return document, title + "\n" + table(found, ns.top)


def cmd_plan(cfg: TrainConfig, ns: argparse.Namespace) -> int:
    document, text = plan(cfg, ns)
    if ns.json:
        print(json.dumps(document, indent=2))
    else:
        print(text)
    return 0
