"""Start ranks with torchrun's elastic launcher (``torch.distributed.run``), never our own.

We only translate syncline's options into torchrun's own arguments and hand over; a failed
worker comes back as torchrun's ``ChildFailedError``, which :func:`launch` turns into a
:class:`LaunchError` naming the rank, its exit code and the first lines of its error.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from syncline.errors import CommError
from syncline.launch.lifeline import AGENT_PID_VARIABLE


class LaunchError(CommError):
    """One or more ranks of a launched job failed."""


@dataclass(frozen=True)
class LaunchSpec:
    """What to start: ``nproc_per_node`` copies of ``python -m module *args`` per node."""

    module: str
    args: tuple[str, ...]
    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    threads_per_rank: int = 1
    log_dir: str | None = None
    max_restarts: int = 0


def torchrun_argv(spec: LaunchSpec) -> list[str]:
    """The ``torchrun`` command line for ``spec`` (also what a user can run by hand)."""
    argv = [
        f"--nproc-per-node={spec.nproc_per_node}",
        f"--max-restarts={spec.max_restarts}",
        "--monitor-interval=0.2",
    ]
    if spec.nnodes == 1 and not spec.rdzv_endpoint:
        argv.append("--standalone")
    else:
        # static rendezvous honours --node-rank, so node i is node i (topology depends on it)
        argv += [
            f"--nnodes={spec.nnodes}",
            f"--node-rank={spec.node_rank}",
            "--rdzv-backend=static",
            f"--rdzv-endpoint={spec.rdzv_endpoint}",
        ]
        host, _, port = (spec.rdzv_endpoint or "").rpartition(":")
        argv += [f"--master-addr={host}", f"--master-port={port}"]
    if spec.log_dir:
        argv.append(f"--log-dir={spec.log_dir}")
    return [*argv, "--module", spec.module, *spec.args]


def launch(spec: LaunchSpec, argv: Sequence[str] | None = None) -> None:
    """Run the job to completion through torchrun; raise :class:`LaunchError` on failure."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    os.environ.setdefault("OMP_NUM_THREADS", str(spec.threads_per_rank))
    args = get_args_parser().parse_args(list(argv) if argv is not None else torchrun_argv(spec))
    # the agent is this process: its workers die with it (syncline.launch.lifeline)
    before = os.environ.get(AGENT_PID_VARIABLE)
    os.environ[AGENT_PID_VARIABLE] = str(os.getpid())
    try:
        run(args)
    except ChildFailedError as exc:
        raise LaunchError(_describe(exc)) from None
    finally:
        if before is None:
            os.environ.pop(AGENT_PID_VARIABLE, None)
        else:
            os.environ[AGENT_PID_VARIABLE] = before


def _blame_order(failure: object) -> tuple[bool, bool, int]:
    """Sort key putting the likely cause first.

    Ranks the agent killed (negative exit code: its SIGTERM) and ranks that failed in a
    collective because a peer vanished are consequences; timestamps only have one-second
    resolution, so they break ties last.
    """
    code = getattr(failure, "exitcode", 0)
    message = str(getattr(failure, "message", ""))
    victim_of_peer = "CommError" in message or "closed by peer" in message
    return (isinstance(code, int) and code < 0, victim_of_peer, getattr(failure, "timestamp", 0))


def _describe(exc: object) -> str:
    """Name the rank that failed first (the cause) before those stopped because of it."""
    failures = getattr(exc, "failures", {}) or {}
    parts = []
    ordered = sorted(failures.items(), key=lambda kv: _blame_order(kv[1]))
    for local_rank, failure in ordered:
        rank = getattr(failure, "rank", local_rank)
        code = getattr(failure, "exitcode", "?")
        message = ""
        error = getattr(failure, "message", None)
        if isinstance(error, dict):
            message = str(error.get("message", ""))
        elif error:
            message = str(error)
        first = message.strip().splitlines()[0][:300] if message.strip() else ""
        if first.startswith("To enable traceback"):
            first = ""
        reason = f"exit code {code}" + (f": {first}" if first else "")
        if isinstance(code, int) and code < 0:
            reason = f"killed by signal {-code}"
        parts.append(f"rank {rank} ({reason})")
    if not parts:
        return "a rank failed"
    text = f"{parts[0]} failed first"
    if len(parts) > 1:
        text += "; then stopped: " + ", ".join(parts[1:])
    return text
