"""gloo across an emulated link: one rank per network namespace, rendezvous and allreduce by TCP.

Needs root and iproute2 (skips otherwise). Inside a namespace gloo must be told its NIC with
``GLOO_SOCKET_IFNAME``; otherwise it resolves the hostname, which points outside the namespace.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from syncline.launch.netns import (
    HOST_IFNAME,
    EmulatedNetwork,
    NetworkEmulationError,
    check_prerequisites,
)

pytestmark = pytest.mark.slow  # namespaces, links and traffic shaping: the full tier only

REPO = Path(__file__).resolve().parents[2]
WORLD = 2
NUMEL = 1 << 18  # 1 MiB of float32: many frames through the tbf, well under a second each way

RANK = """
import sys
from datetime import timedelta
import torch
import torch.distributed as dist
rank, world, numel, addr = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
dist.init_process_group(
    "gloo", init_method=f"tcp://{addr}:29511", rank=rank, world_size=world,
    timeout=timedelta(seconds=20),
)
t = torch.full((numel,), float(rank + 1))
dist.all_reduce(t)
expected = float(world * (world + 1) // 2)
print("ok" if torch.equal(t, torch.full((numel,), expected)) else f"bad {t[:4]}", flush=True)
dist.destroy_process_group()
"""


def test_gloo_allreduce_across_namespaces() -> None:
    try:
        check_prerequisites()
    except NetworkEmulationError as exc:
        pytest.skip(str(exc))
    env = {**os.environ, "GLOO_SOCKET_IFNAME": HOST_IFNAME, "OMP_NUM_THREADS": "1"}
    with EmulatedNetwork(WORLD, "200mbit") as net:
        addr = net.hosts[0][1]
        ranks = [
            subprocess.Popen(
                net.exec_argv(
                    r, [sys.executable, "-c", RANK, str(r), str(WORLD), str(NUMEL), addr]
                ),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
                cwd=REPO,
            )
            for r in range(WORLD)
        ]
        try:
            results = [rank.communicate(timeout=60) for rank in ranks]
        finally:
            for rank in ranks:
                rank.kill()
                rank.wait()
    for r, (rank, (out, err)) in enumerate(zip(ranks, results, strict=True)):
        assert rank.returncode == 0 and out.strip() == "ok", f"rank {r}: {out}\n{err[-2000:]}"


def _allreduce_rank(rank: int, world: int) -> list[float]:
    import torch.distributed as dist

    t = torch.full((1 << 16,), float(rank + 1))
    dist.all_reduce(t)
    return t[:2].tolist()


def _failing_rank(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("rank one gives up")
    return rank


def test_run_ranks_emulated_puts_each_rank_on_its_host_and_names_a_failure() -> None:
    """The benchmarks' launcher: a function on every emulated host, results back in rank
    order, and a rank that raises named with its error."""
    try:
        check_prerequisites()
    except NetworkEmulationError as exc:
        pytest.skip(str(exc))
    from syncline.testing.emulated import run_ranks_emulated
    from syncline.testing.harness import RankFailure

    with EmulatedNetwork(WORLD, "200mbit") as net:
        assert run_ranks_emulated(net, _allreduce_rank, timeout_s=90) == [[3.0, 3.0]] * WORLD
        with pytest.raises(RankFailure, match="rank 1") as info:
            run_ranks_emulated(net, _failing_rank, timeout_s=90)
        assert "rank one gives up" in str(info.value)


def _where(rank: int, world: int) -> tuple[str, float]:
    import torch.distributed as dist

    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return os.readlink("/proc/self/ns/net"), float(t)


def test_run_ranks_emulated_puts_a_nodes_ranks_in_one_namespace() -> None:
    """``ranks_per_host``: consecutive ranks share their node's namespace (2 nodes x 2 ranks),
    and all four still form one group across the link."""
    try:
        check_prerequisites()
    except NetworkEmulationError as exc:
        pytest.skip(str(exc))
    from syncline.testing.emulated import run_ranks_emulated

    with EmulatedNetwork(2, "200mbit") as net:
        got = run_ranks_emulated(net, _where, timeout_s=90, ranks_per_host=2)
    spaces = [ns for ns, _ in got]
    assert spaces[0] == spaces[1] != spaces[2] == spaces[3]
    assert spaces[0] != os.readlink("/proc/self/ns/net")
    assert [total for _, total in got] == [6.0] * 4
