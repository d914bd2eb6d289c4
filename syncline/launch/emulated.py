"""Run a torchrun job whose nodes are network namespaces on this machine (a slow cluster).

Each emulated node is one :class:`~syncline.launch.netns.EmulatedNetwork` host running its own
``torchrun`` agent with static rendezvous at host 0, exactly as on a real cluster, so the
collectives cross a real, rate-limited network stack. The namespaces and links are removed
when the job ends, fails or is interrupted.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

from syncline.launch.netns import HOST_IFNAME, EmulatedNetwork
from syncline.launch.torchrun import LaunchError, LaunchSpec, torchrun_argv

RDZV_PORT = 29500


def launch_emulated(spec: LaunchSpec, rate: str, log_dir: Path, poll_s: float = 0.2) -> None:
    """Start ``spec.nnodes`` namespaced nodes joined at ``rate``; wait for all of them.

    Node 0's output goes to this terminal; node ``i``'s to ``log_dir/node{i}.log``.

    Raises:
        LaunchError: naming the node (and its ranks) that failed first.
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    with EmulatedNetwork(spec.nnodes, rate) as net:
        endpoint = f"{net.hosts[0][1]}:{RDZV_PORT}"
        env = {
            **os.environ,
            "GLOO_SOCKET_IFNAME": HOST_IFNAME,
            "OMP_NUM_THREADS": str(spec.threads_per_rank),
        }
        procs: list[subprocess.Popen[bytes]] = []
        logs = []
        try:
            for node in range(spec.nnodes):
                node_spec = dataclasses.replace(
                    spec,
                    node_rank=node,
                    rdzv_endpoint=endpoint,
                    log_dir=str(log_dir / f"node{node}"),
                )
                argv = net.exec_argv(
                    node, [sys.executable, "-m", "torch.distributed.run", *torchrun_argv(node_spec)]
                )
                out = None
                if node > 0:
                    out = (log_dir / f"node{node}.log").open("wb")
                    logs.append(out)
                procs.append(
                    subprocess.Popen(
                        argv, env=env, stdout=out, stderr=subprocess.STDOUT if out else None
                    )
                )
            _wait(procs, spec.nproc_per_node, poll_s)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            for p in procs:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            for f in logs:
                f.close()


def _wait(procs: list[subprocess.Popen[bytes]], per_node: int, poll_s: float) -> None:
    while True:
        codes = [p.poll() for p in procs]
        failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            node = failed[0]
            first, last = node * per_node, (node + 1) * per_node - 1
            ranks = f"rank {first}" if first == last else f"ranks {first}-{last}"
            raise LaunchError(
                f"emulated node {node} ({ranks}) failed first with exit code {codes[node]}"
            )
        if all(c == 0 for c in codes):
            return
        time.sleep(poll_s)
