"""torchrun's part of a launch, played in-process: a job's workers forked from the harness's server.

``syncline train`` and ``plan --profile`` hand a :class:`~syncline.launch.torchrun.LaunchSpec`
to :func:`~syncline.launch.torchrun.launch`, which starts torchrun's agent and ``python -m
module`` per rank (~7 s before a worker's first line on a shared 2-core machine).
:func:`torchrun_in_process` swaps that one call for :func:`launch_in_process`, so a test runs
the whole command (its parsing, validation, run directory, output and exit code) and the
workers' own ``main``, and pays neither torchrun nor torch's import per rank.

What a worker gets is what torchrun gives it: ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` of a store this
process serves (as torchrun's agent does: ``TORCHELASTIC_USE_AGENT_STORE``; the port is the
system's pick, so no port races), ``TORCHELASTIC_RESTART_COUNT`` and ``OMP_NUM_THREADS``, the
command's directory as its working directory and first import path, and an error file for
``@record``. A failed worker stops the others, as torchrun's agent stops them; the job then
starts again up to ``max_restarts`` times, or fails with a
:class:`~syncline.launch.torchrun.LaunchError` naming the rank that failed first. What the
workers print is printed here when the job ends, rank by rank.

Only torchrun itself is not tested here: one node (``nnodes=1``), no signals forwarded. The
launcher's own tests keep the real one.

Example:
    >>> with torchrun_in_process():  # doctest: +SKIP
    ...     main(["train", "--steps", "2"])
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from syncline.errors import ConfigError
from syncline.launch import torchrun
from syncline.launch.torchrun import LaunchError, LaunchSpec
from syncline.testing.harness import _context

__all__ = ["launch_in_process", "torchrun_in_process"]

_STOP_GRACE_S = 5.0  # a stopped worker's time to leave on SIGTERM, then SIGKILL


def _worker(
    module: str, args: tuple[str, ...], environ: dict[str, str], cwd: str, log: str
) -> None:
    """One rank: torchrun's environment, started from ``cwd``, output to ``log.stdout`` and
    ``log.stderr`` (unbuffered, as a worker's), exiting with what the module's main returns."""
    for fd, name in ((1, "stdout"), (2, "stderr")):
        target = os.open(f"{log}.{name}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=True)  # type: ignore[union-attr]
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    # ``python -m`` puts the working directory first, then PYTHONPATH's entries
    extra = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:0] = [cwd, *extra]
    sys.argv = [module, *args]
    raise SystemExit(importlib.import_module(module).main(list(args)))


def _environ(spec: LaunchSpec, rank: int, port: int, attempt: int, log: str) -> dict[str, str]:
    """What torchrun sets for local rank ``rank`` of a one-node job (its agent's store)."""
    return {
        **os.environ,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(spec.nproc_per_node),
        "LOCAL_WORLD_SIZE": str(spec.nproc_per_node),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(spec.nproc_per_node),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": str(attempt),
        "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
        "TORCHELASTIC_ERROR_FILE": f"{log}.error.json",
        "OMP_NUM_THREADS": str(spec.threads_per_rank),
        "PYTHONUNBUFFERED": "1",
    }


def _first_line(error_file: str) -> str:
    """The first line of the error ``@record`` wrote for a worker ('' if none)."""
    try:
        with open(error_file) as f:
            message = json.load(f)["message"]
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    text = str(message.get("message", "") if isinstance(message, dict) else message).strip()
    return text.splitlines()[0][:300] if text else ""


def _wait(procs: list[Any], timeout_s: float) -> list[int]:
    """Until every worker exited or one failed: the ranks that failed, in rank order.

    Raises:
        LaunchError: the workers ran past ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        codes = [p.exitcode for p in procs]
        failed = [r for r, code in enumerate(codes) if code not in (None, 0)]
        if failed or all(code == 0 for code in codes):
            return failed
        if time.monotonic() > deadline:
            alive = [r for r, code in enumerate(codes) if code is None]
            raise LaunchError(f"ranks {alive} did not finish within {timeout_s}s")
        time.sleep(0.05)


def _stop(procs: list[Any]) -> list[int]:
    """Stop the workers still running (SIGTERM, then SIGKILL); the ranks stopped."""
    stopped = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(_STOP_GRACE_S)
        if p.is_alive():
            p.kill()
            p.join()
    return stopped


def _attempt(spec: LaunchSpec, attempt: int, logs: str, timeout_s: float) -> str | None:
    """Run every worker once; None if all exited 0, else what failed, the cause first."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = _context(None)
    procs, paths = [], []
    try:
        for rank in range(spec.nproc_per_node):
            paths.append(os.path.join(logs, f"attempt{attempt}.rank{rank}"))
            environ = _environ(spec, rank, store.port, attempt, paths[-1])
            args = (spec.module, spec.args, environ, os.getcwd(), paths[-1])
            procs.append(ctx.Process(target=_worker, args=args))
            procs[-1].start()
        failed = _wait(procs, timeout_s)
    finally:  # as torchrun's agent: once one worker fails, the others are stopped
        stopped = _stop(procs)
        del store
        _print_output(paths)
    if not failed:
        return None
    parts = []
    for rank in failed:
        line = _first_line(f"{paths[rank]}.error.json")
        parts.append(f"rank {rank} (exit code {procs[rank].exitcode}{': ' + line if line else ''})")
    parts += [f"rank {r} (killed by signal {int(signal.SIGTERM)})" for r in stopped]
    return f"{parts[0]} failed first" + (
        "; then stopped: " + ", ".join(parts[1:]) if parts[1:] else ""
    )


def _print_output(paths: list[str]) -> None:
    """What the workers printed, here: every rank's stdout, then every rank's stderr."""
    for name, stream in (("stdout", sys.stdout), ("stderr", sys.stderr)):
        for path in paths:
            if os.path.exists(f"{path}.{name}"):
                stream.write(Path(f"{path}.{name}").read_text(errors="replace"))
        stream.flush()


def launch_in_process(spec: LaunchSpec, argv: Any = None, *, timeout_s: float = 300.0) -> None:
    """Run ``spec``'s job to completion as torchrun would, its workers forked here.

    Args:
        spec: what :func:`syncline.launch.torchrun.launch` was given; one node only.
        argv: torchrun's own arguments; refused (they are for the real launcher).
        timeout_s: each attempt's limit; past it, its workers are killed.

    Raises:
        ConfigError: a multi-node spec, or ``argv``.
        LaunchError: the last attempt failed (naming the rank that failed first).
    """
    if spec.nnodes != 1 or spec.rdzv_endpoint or argv is not None:
        raise ConfigError(
            f"launch_in_process: one node, no torchrun arguments (nnodes={spec.nnodes}, "
            f"rdzv_endpoint={spec.rdzv_endpoint!r}, argv={argv!r}); use the real launcher"
        )
    with tempfile.TemporaryDirectory(prefix="syncline-launch-") as logs:
        for attempt in range(spec.max_restarts + 1):
            failure = _attempt(spec, attempt, logs, timeout_s)
            if failure is None:
                return
        raise LaunchError(failure)


@contextlib.contextmanager
def torchrun_in_process() -> Iterator[None]:
    """While open, :func:`syncline.launch.torchrun.launch` is :func:`launch_in_process`."""
    real = torchrun.launch
    torchrun.launch = launch_in_process
    try:
        yield
    finally:
        torchrun.launch = real
