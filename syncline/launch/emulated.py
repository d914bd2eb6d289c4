"""Run one process per host of an emulated network (namespaces on this machine, a slow cluster).

:func:`run_on_hosts` is the one place that starts processes inside the hosts of a
:class:`~syncline.launch.netns.EmulatedNetwork`: command ``i`` runs on host ``i`` with gloo
pointed at the emulated NIC, the launcher polls all of them, names the first that fails, and
always stops the others. Two callers build on it:

* :func:`launch_emulated` (``syncline train --emulate-network``): each host is one node
  running its own ``torchrun`` agent with static rendezvous at host 0, exactly as on a real
  cluster, so the collectives cross a real, rate-limited network stack.
* :func:`syncline.testing.emulated.run_ranks_emulated` (benchmarks): one rank of a Python
  function per host, like :func:`syncline.testing.run_ranks` on the loopback.

The namespaces and links are removed when the job ends, fails or is interrupted.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

from syncline.launch.netns import HOST_IFNAME, EmulatedNetwork
from syncline.launch.torchrun import LaunchError, LaunchSpec, torchrun_argv

__all__ = ["RDZV_PORT", "HostFailure", "launch_emulated", "run_on_hosts"]

RDZV_PORT = 29500
"""torchrun's rendezvous port on host 0 (each network has its own port space)."""

_STOP_GRACE_S = 10.0


class HostFailure(LaunchError):
    """A process on an emulated host exited non-zero or did not finish in time.

    Attributes:
        host: index of the host named in the message.
        exitcode: its exit code (negative: killed by that signal); ``None`` on a timeout.
    """

    def __init__(self, message: str, host: int, exitcode: int | None) -> None:
        super().__init__(message)
        self.host = host
        self.exitcode = exitcode


def run_on_hosts(
    net: EmulatedNetwork,
    commands: Sequence[Sequence[str]],
    *,
    threads: int = 1,
    env: Mapping[str, str] | None = None,
    logs: Sequence[Path | None] | None = None,
    cwd: str | Path | None = None,
    labels: Sequence[str] | None = None,
    timeout_s: float | None = None,
    poll_s: float = 0.2,
    hosts: Sequence[int] | None = None,
) -> None:
    """Run ``commands[i]`` on host ``i`` (or ``hosts[i]``) of the started ``net``, all at once;
    wait for all.

    Every process gets this process's environment plus ``GLOO_SOCKET_IFNAME`` (the emulated
    NIC: inside a namespace gloo must be told it, the hostname resolves outside) and
    ``OMP_NUM_THREADS``, then ``env`` on top. Whatever happens, no process outlives the call:
    on a failure, a timeout or an interrupt the others get SIGTERM, then SIGKILL.

    Args:
        net: a started network with at least ``len(commands)`` hosts.
        commands: one argv per host, in host order.
        threads: ``OMP_NUM_THREADS`` of every process (they share this machine's cores).
        env: extra environment variables.
        logs: per host, a file for its stdout and stderr, or ``None`` for this terminal.
        cwd: working directory of every process.
        labels: per host, how messages name it; default ``"emulated host <i>"``.
        timeout_s: limit for the whole run; ``None`` waits as long as it takes.
        poll_s: seconds between two looks at the processes.
        hosts: the host of each command, when several share one (the ranks of one node:
            they reach each other inside the namespace, over its loopback, and the other
            hosts through its one rate-limited link); default: command ``i`` on host ``i``.

    Raises:
        HostFailure: naming the command (by its label) whose process failed first (several
            failing between two looks: the lowest index), or the first one still running at
            the deadline.

    Example:
        >>> with EmulatedNetwork(2, "100mbit") as net:  # doctest: +SKIP
        ...     run_on_hosts(net, [["ping", "-c1", net.hosts[1][1]], ["true"]])
    """
    where = list(hosts) if hosts is not None else list(range(len(commands)))
    if len(where) != len(commands) or not all(0 <= h < net.num_hosts for h in where):
        raise LaunchError(
            f"hosts={where} for {len(commands)} commands: one host index in "
            f"[0, {net.num_hosts}) per command"
        )
    names = list(labels) if labels is not None else []
    names += [f"emulated host {i}" for i in range(len(names), len(commands))]
    full_env = {
        **os.environ,
        "GLOO_SOCKET_IFNAME": HOST_IFNAME,
        "OMP_NUM_THREADS": str(threads),
        **(env or {}),
    }
    procs: list[subprocess.Popen[bytes]] = []
    files: list[IO[bytes]] = []
    try:
        for host, argv in enumerate(commands):
            path = logs[host] if logs is not None else None
            out = path.open("wb") if path is not None else None
            if out is not None:
                files.append(out)
            procs.append(
                subprocess.Popen(
                    net.exec_argv(where[host], list(argv)),
                    env=full_env,
                    cwd=cwd,
                    stdout=out,
                    stderr=subprocess.STDOUT if out is not None else None,
                )
            )
        _wait(procs, names, timeout_s, poll_s)
    finally:
        _stop(procs)
        for f in files:
            f.close()


def _wait(
    procs: list[subprocess.Popen[bytes]], names: list[str], timeout_s: float | None, poll_s: float
) -> None:
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        codes = [p.poll() for p in procs]
        failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            host = failed[0]
            raise HostFailure(
                f"{names[host]} failed first with exit code {codes[host]}", host, codes[host]
            )
        pending = [i for i, c in enumerate(codes) if c is None]
        if not pending:
            return
        if deadline is not None and time.monotonic() > deadline:
            late = ", ".join(names[i] for i in pending)
            raise HostFailure(f"{late} did not finish within {timeout_s} s", pending[0], None)
        time.sleep(poll_s)


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM whatever still runs, then SIGKILL what ignores it for ``_STOP_GRACE_S``."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=_STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def launch_emulated(spec: LaunchSpec, rate: str, log_dir: Path, poll_s: float = 0.2) -> None:
    """Start ``spec.nnodes`` namespaced nodes joined at ``rate``; wait for all of them.

    Node 0's output goes to this terminal; node ``i``'s to ``log_dir/node{i}.log``.

    Raises:
        LaunchError: naming the node (and its ranks) that failed first.
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    with EmulatedNetwork(spec.nnodes, rate) as net:
        endpoint = f"{net.hosts[0][1]}:{RDZV_PORT}"
        commands = []
        for node in range(spec.nnodes):
            node_spec = dataclasses.replace(
                spec, node_rank=node, rdzv_endpoint=endpoint, log_dir=str(log_dir / f"node{node}")
            )
            commands.append(
                [sys.executable, "-m", "torch.distributed.run", *torchrun_argv(node_spec)]
            )
        run_on_hosts(
            net,
            commands,
            threads=spec.threads_per_rank,
            logs=[None] + [log_dir / f"node{i}.log" for i in range(1, spec.nnodes)],
            labels=[_node_label(i, spec.nproc_per_node) for i in range(spec.nnodes)],
            poll_s=poll_s,
        )


def _node_label(node: int, per_node: int) -> str:
    first, last = node * per_node, (node + 1) * per_node - 1
    ranks = f"rank {first}" if first == last else f"ranks {first}-{last}"
    return f"emulated node {node} ({ranks})"
