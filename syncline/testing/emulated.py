"""Run a function on N ranks, one per host of an emulated network: ``run_ranks`` on slow links.

The same contract as :func:`syncline.testing.run_ranks` (``fn(rank, world_size, *args)``, each
rank's return value back, :class:`~syncline.testing.RankFailure` naming the rank that failed
first), and the same rank body (:func:`syncline.testing.harness._worker`: a file store for the
rendezvous, so no ports; results through ``torch.save``). Only the processes differ: rank
``i`` is ``python -m syncline.testing.emulated`` started on host ``i`` by
:func:`syncline.launch.emulated.run_on_hosts`, so every collective crosses that host's
rate-limited NIC. The store's file lives in a temporary folder, which the namespaces share
(they separate networks, not file systems).
"""

from __future__ import annotations

import os
import pickle
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from syncline.errors import ConfigError
from syncline.launch.emulated import HostFailure, run_on_hosts
from syncline.launch.netns import EmulatedNetwork
from syncline.testing.harness import RankFailure, _status, _worker

__all__ = ["run_ranks_emulated"]

_MODULE = "syncline.testing.emulated"  # this file, as each rank runs it
_JOB = "job.pkl"
_LOG_TAIL_CHARS = 3000


def run_ranks_emulated(
    net: EmulatedNetwork,
    fn: Callable[..., Any],
    *args: Any,
    timeout_s: float = 180.0,
    threads: int = 1,
    backend: str = "gloo",
    comm_timeout_s: float = 60.0,
    ranks_per_host: int = 1,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` with rank ``i`` on host ``i // ranks_per_host`` of
    the started ``net`` (consecutive ranks share a host, as torchrun numbers a node's ranks).

    Args:
        net: a started network; its ``num_hosts`` is the world size.
        fn: a function importable by name from a module (not the ``__main__`` script: the
            ranks are fresh interpreters that import it); its result must be
            ``torch.save``-able.
        args: extra picklable arguments.
        timeout_s: the whole run's limit; past it, every rank is stopped.
        threads: ``torch.set_num_threads`` and ``OMP_NUM_THREADS`` of each rank.
        backend: process-group backend.
        comm_timeout_s: the process group's own timeout for each collective.
        ranks_per_host: ranks on each host (a node's ranks reach each other over the
            namespace's loopback, the other nodes through its rate-limited link).

    Returns:
        Each rank's return value, in rank order.

    Raises:
        ConfigError: ``fn`` is defined in ``__main__``.
        RankFailure: naming the rank that raised first (with its traceback), died or did not
            finish in time (with the tail of its output).

    Example:
        >>> with EmulatedNetwork(2, "100mbit") as net:  # doctest: +SKIP
        ...     run_ranks_emulated(net, allreduce_rank)
        [1.0, 1.0]
    """
    if getattr(fn, "__module__", "__main__") == "__main__":
        raise ConfigError(
            f"{getattr(fn, '__qualname__', fn)!r} is defined in __main__; the ranks import it "
            "by name, so move it into a module (e.g. run the script with python -m)"
        )
    if not isinstance(ranks_per_host, int) or ranks_per_host < 1:
        raise ConfigError(f"ranks_per_host={ranks_per_host!r}: valid: an int >= 1")
    world = net.num_hosts * ranks_per_host
    workdir = tempfile.mkdtemp(prefix="syncline-hosts-")
    try:
        with open(os.path.join(workdir, _JOB), "wb") as f:
            pickle.dump((fn, args, threads, backend, comm_timeout_s), f)
        # the ranks import what this process imports, from where it imports it
        path = os.pathsep.join(p or os.getcwd() for p in sys.path)
        logs = [Path(workdir) / f"rank{r}.log" for r in range(world)]
        try:
            run_on_hosts(
                net,
                [
                    [sys.executable, "-m", _MODULE, workdir, str(r), str(world)]
                    for r in range(world)
                ],
                threads=threads,
                env={"PYTHONPATH": path},
                logs=logs,
                cwd=os.getcwd(),
                labels=[f"rank {r} (emulated host {r // ranks_per_host})" for r in range(world)],
                timeout_s=timeout_s,
                hosts=[r // ranks_per_host for r in range(world)],
            )
        except HostFailure as exc:
            raise _rank_failure(exc, workdir, logs) from None
        import torch

        return [
            torch.load(os.path.join(workdir, f"rank{r}.pt"), weights_only=False, map_location="cpu")
            for r in range(world)
        ]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _rank_failure(exc: HostFailure, workdir: str, logs: list[Path]) -> RankFailure:
    """The earliest traceback a rank wrote, else the failing host's exit and output tail."""
    errors = []
    for rank in range(len(logs)):
        status = _status(workdir, rank)
        if status is not None and status.startswith("error"):
            mtime = os.stat(os.path.join(workdir, f"rank{rank}.status")).st_mtime_ns
            errors.append((mtime, rank, status.removeprefix("error\n").strip()))
    if errors:
        _, rank, detail = min(errors)
        return RankFailure(rank, detail)
    tail = logs[exc.host].read_text(errors="replace")[-_LOG_TAIL_CHARS:].strip()
    return RankFailure(exc.host, f"{exc}" + (f"; its output ends:\n{tail}" if tail else ""))


def _main(argv: list[str]) -> int:
    """One rank inside its namespace: ``python -m syncline.testing.emulated DIR RANK WORLD``."""
    workdir, rank, world = argv[0], int(argv[1]), int(argv[2])
    with open(os.path.join(workdir, _JOB), "rb") as f:
        fn, args, threads, backend, comm_timeout_s = pickle.load(f)
    _worker(fn, rank, world, workdir, args, threads, backend, comm_timeout_s)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
