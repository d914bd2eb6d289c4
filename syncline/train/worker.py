"""Entry point of one rank under torchrun: ``python -m syncline.train.worker CONFIG.json``.

This is launcher-facing code, so it is where the environment torchrun sets is read.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from syncline import comm
from syncline.comm.registry import build_allreduce
from syncline.comm.topology import Topology
from syncline.launch.lifeline import AGENT_PID_VARIABLE, die_with_parent
from syncline.registry import import_plugins
from syncline.train.common import rank_backend_and_device
from syncline.train.config import TrainConfig
from syncline.train.loop import train


def run_rank(
    cfg: TrainConfig,
    rank: int,
    world: int,
    device: torch.device,
    *,
    ranks_per_node: int,
    attempt: int = 0,
) -> dict[str, Any]:
    """Train on this rank once its default group is up; returns the run summary (complete
    on rank 0). What torchrun tells a worker through its environment comes in as arguments
    (``ranks_per_node``: the node size a hierarchical allreduce uses; ``attempt``: the
    restart count), so :func:`syncline.testing.run_training` runs exactly this in-process.
    """
    allreduce: str | comm.Collective = "flat"
    if (
        cfg.dp.allreduce != "flat" and not cfg.pipeline.pipelined
    ):  # a pipeline's replicas: their own
        allreduce = build_allreduce(
            cfg.dp.allreduce, timeout_s=cfg.timeout_s, ranks_per_node=ranks_per_node
        )
    summary = train(
        cfg,
        rank,
        world,
        device,
        allreduce=allreduce,
        ranks_per_node=ranks_per_node,
        attempt=attempt,
    )
    # Leave together: a rank that tears its process groups down while a peer is still
    # taking its last message (rank 0 gathers the stage weights and traces one rank at a
    # time) was seen to abort inside gloo at exit ("terminate called without an active
    # exception", 4-rank pipeline runs). Rank 0 arrives after writing the run directory.
    comm.barrier(timeout_s=cfg.timeout_s, what="end-of-training barrier")
    return summary


@record
def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    agent = os.environ.get(AGENT_PID_VARIABLE)
    die_with_parent(int(agent) if agent else None)  # never outlive the launcher
    if len(args) != 1:
        print("usage: python -m syncline.train.worker CONFIG.json", file=sys.stderr)
        return 2
    with open(args[0]) as f:
        values = json.load(f)
    import_plugins(values.get("plugins", ()))  # before the config names their entries
    cfg = TrainConfig.from_dict(values)
    torch.set_num_threads(cfg.threads)
    backend, device = rank_backend_and_device(cfg, int(os.environ.get("LOCAL_RANK", "0")))
    rank, world = comm.init_from_env(backend=backend, timeout_s=cfg.timeout_s)
    try:
        per_node = cfg.dp.ranks_per_node or os.environ.get("LOCAL_WORLD_SIZE", str(world))
        # torchrun counts the restarts of the whole worker group (--max-restarts)
        run_rank(
            cfg,
            rank,
            world,
            device,
            ranks_per_node=Topology.from_env_values(world, per_node).ranks_per_node,
            attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        )
    finally:
        comm.destroy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
