"""Run a function on N local ranks with a real gloo group: the harness of tests and benchmarks.

Each rank is a fresh process forked from a ``forkserver`` that imported torch and syncline once
(Linux; ``spawn`` elsewhere): no thread pool or process group is inherited, since the server
only imported, and a run does not pay torch's import (seconds) per rank. The group is started
from a temporary :class:`torch.distributed.FileStore` (no ports, so no port races between
parallel test runs), and results come back through files written by ``torch.save``. A rank that
raises, crashes or hangs ends the whole run with :class:`RankFailure` naming that rank; the
others are terminated, so a test never hangs.

Example:
    >>> def allreduce_rank(rank: int, world: int) -> float:
    ...     t = torch.tensor([float(rank)])
    ...     torch.distributed.all_reduce(t)
    ...     return t.item()
    >>> run_ranks(allreduce_rank, 2)
    [1.0, 1.0]
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from typing import Any

from syncline.errors import ConfigError
from syncline.fields import check_int


class RankFailure(RuntimeError):
    """One rank of a local run raised, crashed or timed out."""

    def __init__(self, rank: int, detail: str) -> None:
        super().__init__(f"rank {rank} failed: {detail}")
        self.rank = rank
        self.detail = detail


def _write_status(path: str, text: str) -> None:
    """Write atomically: the parent polls, and must never read a half-written status."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


#: Modules the forkserver imports once, so that every rank forked from it starts with them.
# torch._dynamo: the fake-backend tests reach it, and importing it per rank costs ~3 s
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "syncline.comm"]


def preload(modules: Iterable[str]) -> None:
    """Have the fork server also import ``modules`` when it starts, once for all its ranks.

    For a session whose ranks import them anyway (the test suite's: the trainer, pyplot,
    the models it traces), where each rank would otherwise pay their import, seconds, and,
    with no bytecode cached (``PYTHONDONTWRITEBYTECODE``, a fresh checkout), compile them
    again. A short script would pay for what it does not use, hence not by default. No
    effect on a server already started; a module that fails to import is skipped.

    Example:
        >>> preload(["syncline.train.worker"])  # doctest: +SKIP
    """
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)


def _context(method: str | None) -> Any:
    """The start method of ranks: ``forkserver`` with torch preloaded where there is one.

    ``spawn`` (the argument, or ``SYNCLINE_START_METHOD=spawn``) gives a fresh interpreter per
    rank, as a user's ``torchrun`` does: for measuring a rank's resident memory (a forked
    rank's counts pages it shares with the server) or to rule the server out of a failure.
    """
    method = method or os.environ.get("SYNCLINE_START_METHOD", "")
    if method not in ("", "spawn", "forkserver"):
        raise ConfigError(
            f"start method {method!r} (start_method or SYNCLINE_START_METHOD): expected "
            "'spawn' or 'forkserver'"
        )
    if not method:
        method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    workdir: str,
    args: tuple[Any, ...],
    threads: int,
    backend: str,
    comm_timeout_s: float,
    environ: dict[str, str] | None = None,
) -> None:
    if environ is not None:  # a forked rank has the server's environment, not the caller's now
        os.environ.clear()
        os.environ.update(environ)
    import torch

    from syncline import comm

    torch.set_num_threads(threads)
    status_path = os.path.join(workdir, f"rank{rank}.status")
    try:
        comm.init_with_file_store(
            os.path.join(workdir, "store"),
            rank,
            world_size,
            backend=backend,
            timeout_s=comm_timeout_s,
        )
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(workdir, f"rank{rank}.pt"))
        _write_status(status_path, "ok")
    except BaseException:
        _write_status(status_path, "error\n" + traceback.format_exc())
        raise SystemExit(1) from None
    finally:
        comm.destroy()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 180.0,
    threads: int = 1,
    backend: str = "gloo",
    comm_timeout_s: float = 60.0,
    start_method: str | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return each result.

    Args:
        fn: a module-level (picklable) function; its return value must be ``torch.save``-able.
        world_size: number of ranks, >= 1.
        args: extra picklable arguments.
        timeout_s: the whole run's limit; past it, every rank is killed.
        threads: ``torch.set_num_threads`` per rank (ranks share the machine's cores).
        backend: process-group backend.
        comm_timeout_s: the process group's own timeout for each collective.
        start_method: ``"spawn"`` or ``"forkserver"``; default ``SYNCLINE_START_METHOD`` or,
            unset, ``"forkserver"`` where the platform has it.

    Raises:
        RankFailure: naming the first rank that raised, died or did not finish in time.
    """
    check_int("world_size", world_size)
    ctx = _context(start_method)
    environ = dict(os.environ)
    workdir = tempfile.mkdtemp(prefix="syncline-ranks-")
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, r, world_size, workdir, args, threads, backend, comm_timeout_s, environ),
            daemon=True,
        )
        for r in range(world_size)
    ]
    try:
        for p in procs:
            p.start()
        _wait_all(procs, workdir, timeout_s)
        import torch

        return [
            torch.load(os.path.join(workdir, f"rank{r}.pt"), weights_only=False, map_location="cpu")
            for r in range(world_size)
        ]
    finally:
        for p in procs:
            if p.pid is None:  # never started
                continue
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        shutil.rmtree(workdir, ignore_errors=True)


def _status(workdir: str, rank: int) -> str | None:
    path = os.path.join(workdir, f"rank{rank}.status")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read()


def _first_failure(procs: list[Any], workdir: str) -> RankFailure:
    """The rank that failed first: later failures are usually peers losing their connection.

    A rank that died without a word (killed, or crashed in C) is named before any rank that
    raised: its peers' errors ("connection closed by peer") are what its death caused, and
    they may be written before the dead process is seen to be gone.
    """
    time.sleep(0.5)
    for rank, p in enumerate(procs):
        if _status(workdir, rank) is None and not p.is_alive():
            p.join(timeout=1)
            if _status(workdir, rank) is None:
                return RankFailure(rank, f"process exited with code {p.exitcode}")
    failed = []
    for rank in range(len(procs)):
        path = os.path.join(workdir, f"rank{rank}.status")
        status = _status(workdir, rank)
        if status is not None and status.startswith("error"):
            failed.append((os.stat(path).st_mtime_ns, rank, status))
    _, rank, status = min(failed)
    return RankFailure(rank, status.removeprefix("error\n").strip())


def _wait_all(procs: list[Any], workdir: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        pending = []
        for rank, p in enumerate(procs):
            status = _status(workdir, rank)
            if status is not None and status.startswith("error"):
                raise _first_failure(procs, workdir)
            if status is None and not p.is_alive():
                p.join(timeout=1)
                status = _status(workdir, rank)
                if status is None:
                    raise RankFailure(rank, f"process exited with code {p.exitcode}")
            if status is None:
                pending.append(rank)
        if not pending:
            return
        if time.monotonic() > deadline:
            raise RankFailure(pending[0], f"ranks {pending} did not finish within {timeout_s}s")
        time.sleep(0.02)
