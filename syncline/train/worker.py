"""Entry point of one rank under torchrun: ``python -m syncline.train.worker CONFIG.json``.

This is launcher-facing code, so it is where the environment torchrun sets is read.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

from syncline import comm
from syncline.comm.liveness import Heartbeat, describe_silent
from syncline.comm.registry import build_allreduce
from syncline.comm.topology import Topology
from syncline.errors import CheckpointError, CommError, CommTimeout, ConfigError
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


#: failures a run can meet that are not bugs: each ends its rank with one line on the
#: console (the traceback goes to ``RUN_DIR/logs/rank{R}.log``)
EXPECTED = (CommError, CheckpointError, ConfigError, OSError)


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
    return run_worker(TrainConfig.from_dict(values))


def run_worker(cfg: TrainConfig) -> int:
    """Train as the rank torchrun's environment names (``RANK``, ``LOCAL_RANK``, ...): what
    a worker started by ``syncline train`` runs, and what ``syncline train`` itself runs when
    torchrun started it (then it is one of the workers); the exit code (1 after an expected
    failure, told in one line)."""
    torch.set_num_threads(cfg.threads)
    backend, device = rank_backend_and_device(cfg, int(os.environ.get("LOCAL_RANK", "0")))
    rank, world = comm.init_from_env(backend=backend, timeout_s=cfg.timeout_s)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    heartbeat = _heartbeat(rank, world, attempt)
    try:
        per_node = cfg.dp.ranks_per_node or os.environ.get("LOCAL_WORLD_SIZE", str(world))
        # torchrun counts the restarts of the whole worker group (--max-restarts)
        run_rank(
            cfg,
            rank,
            world,
            device,
            ranks_per_node=Topology.from_env_values(world, per_node).ranks_per_node,
            attempt=attempt,
        )
    except EXPECTED as exc:
        if isinstance(exc, CommError):  # who did not answer, and stop them (a hung rank)
            kind = CommTimeout if isinstance(exc, CommTimeout) else CommError
            named = kind(_first_line(exc) + describe_silent(heartbeat))
            named.__cause__ = exc  # its traceback goes to the log
            exc = named
        return fail_in_one_line(cfg, rank, attempt, exc)
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        comm.destroy()
    return 0


def _heartbeat(rank: int, world: int, attempt: int) -> Heartbeat | None:
    """This rank's heartbeat in the job's store (:mod:`syncline.comm.liveness`), or None
    where the store cannot be reached (a failure to answer is then named by no one)."""
    if world == 1 or "MASTER_ADDR" not in os.environ:
        return None
    try:
        beat = Heartbeat.connect(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            rank,
            world,
            f"/syncline/attempt_{attempt}/liveness/",
        )
        beat.start()
    except (RuntimeError, ValueError, OSError):
        return None
    return beat


def fail_in_one_line(cfg: TrainConfig, rank: int, attempt: int, exc: BaseException) -> int:
    """End this rank after an expected failure: one line on the console, the traceback in
    ``RUN_DIR/logs/rank{R}.log``, the line in torchrun's error file (where the launcher's
    summary reads it); returns the exit code, 1.

    A full disk may refuse the log and the error file: the console line still appears.
    """
    line = _first_line(exc)
    if not line.startswith(f"rank {rank}:"):
        line = f"rank {rank}: {line}"
    log = Path(cfg.run_dir) / "logs" / f"rank{rank}.log"
    try:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a") as f:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            f.write(f"--- attempt {attempt}, {stamp}: {line}\n")
            f.write("".join(traceback.format_exception(exc)))
        where = f" (traceback: {log})"
    except OSError:
        where = ""
    print(line + where, file=sys.stderr, flush=True)
    with contextlib.suppress(Exception), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ErrorHandler().record_exception(type(exc)(line) if _rebuildable(exc) else exc)
    return 1


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return " ".join(text.splitlines()[0].split())


def _rebuildable(exc: BaseException) -> bool:
    """Whether ``type(exc)(message)`` makes an exception of the same type (the error file
    then carries the one line, not a multi-line message)."""
    try:
        type(exc)("x")
    except Exception:
        return False
    return True


if __name__ == "__main__":
    raise SystemExit(main())
