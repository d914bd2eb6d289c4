"""Launching where clusters launch, on one machine: two "nodes" on the loopback, each a
``syncline train`` started with the environment ``srun`` (and, separately, a PyTorchJob's
operator) gives its task, train together to the same weights as one node running both ranks
with the same global batch; ``syncline train`` started by ``torchrun`` trains once, in the
workers torchrun started.

The Slurm runs execute the command line of ``examples/slurm/train.sbatch`` (its ``srun``
line, ``$SLURM_JOB_ID`` expanded and ``"$@"`` given the test's options); the pods run the
container command of ``examples/kubernetes/pytorchjob.yaml``.
"""

from __future__ import annotations

import os
import random
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from syncline.train.checkpoint import load_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "examples" / "slurm" / "train.sbatch"
PYTORCHJOB = REPO / "examples" / "kubernetes" / "pytorchjob.yaml"

#: a small GPT, a few steps; one rank per node (two nodes), or two on the one node
TINY = ["--n-layer", "2", "--n-embd", "32", "--seq-len", "16", "--batch-size", "8"]
TINY += ["--steps", "4", "--log-every", "2", "--eval-every", "0", "--sample-tokens", "0"]
SYNCLINE = [sys.executable, "-m", "syncline.cli.main"]


def _free_port(low: int = 20000, high: int = 40000) -> int:
    """A port in ``[low, high)`` nobody listens on now (Slurm's derived ports lie there)."""
    for _ in range(200):
        port = random.randrange(low, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port")


def _argv(words: list[str]) -> list[str]:
    """``syncline ...`` as this interpreter runs it (the checkout, not an installed copy)."""
    assert words[0] == "syncline", words
    return [*SYNCLINE, *words[1:]]


def _run_nodes(argvs: list[list[str]], envs: list[dict[str, str]], cwd: Path) -> list[str]:
    """Start every node at once (they meet at the rendezvous) and wait for all; stdouts."""
    procs = [
        subprocess.Popen(
            argv,
            cwd=cwd,
            env={**_clean_env(), "PYTHONUNBUFFERED": "1", **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for argv, env in zip(argvs, envs, strict=True)
    ]
    outs = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        outs.append(out)
        assert proc.returncode == 0, out[-3000:]
    return outs


def _clean_env() -> dict[str, str]:
    """This environment without any launcher's variables (a test may run under one)."""
    prefixes = ("SLURM_", "PET_", "TORCHELASTIC_", "MASTER_", "GROUP_", "ROLE_")
    names = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"}
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes) and k not in names}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(run / "checkpoint.pt")["model"]


def _assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


@pytest.fixture(scope="module")
def one_node(tmp_path_factory) -> Path:
    """The reference: one node running both ranks, the same global batch."""
    run = tmp_path_factory.mktemp("one") / "run"
    (out,) = _run_nodes(
        [[*SYNCLINE, "train", *TINY, "--nproc-per-node", "2", "--run-dir", str(run)]],
        [{}],
        run.parent,
    )
    assert "2 rank(s)" in out
    return run


def sbatch_command() -> list[str]:
    """The ``srun`` line of the example job script, as words (``srun`` dropped)."""
    lines = [line for line in SBATCH.read_text().splitlines() if line.startswith("srun ")]
    assert len(lines) == 1, lines
    return shlex.split(lines[0])[1:]


def srun_env(node: int, nodes: int, job: int) -> dict[str, str]:
    """What ``srun`` sets in the task it starts on ``node`` (one task per node)."""
    hosts = f"127.0.0.[1-{nodes}]"  # every 127.x address is this machine's loopback
    return {
        "SLURM_JOB_ID": str(job),
        "SLURM_JOBID": str(job),
        "SLURM_JOB_NODELIST": hosts,
        "SLURM_NODELIST": hosts,
        "SLURM_STEP_NODELIST": hosts,
        "SLURM_JOB_NUM_NODES": str(nodes),
        "SLURM_NNODES": str(nodes),
        "SLURM_STEP_NUM_NODES": str(nodes),
        "SLURM_NTASKS": str(nodes),
        "SLURM_STEP_NUM_TASKS": str(nodes),
        "SLURM_NTASKS_PER_NODE": "1",
        "SLURM_NODEID": str(node),
        "SLURM_PROCID": str(node),
        "SLURM_LOCALID": "0",
        "SLURMD_NODENAME": f"127.0.0.{node + 1}",
    }


def test_two_srun_nodes_train_as_one_node(one_node: Path, tmp_path: Path) -> None:
    port = _free_port()
    job = 40000 + port - 20000  # syncline's rendezvous port for the job: 20000 + id % 20000
    words = sbatch_command()
    assert words[:2] == ["syncline", "train"] and words[-1] == "$@", words
    argvs, envs = [], []
    for node in range(2):
        env = srun_env(node, 2, job)
        # the shell's expansion of $VARIABLE, with the task's values
        expanded = [re.sub(r"\$(\w+)", lambda m, e=env: e[m.group(1)], w) for w in words]
        argvs.append(_argv([*expanded[:-1], *TINY, "--nproc-per-node", "1"]))
        envs.append(env)
    outs = _run_nodes(argvs, envs, tmp_path)
    run = tmp_path / "runs" / f"slurm-{job}"
    assert "node 0 of 2 (Slurm: SLURM_STEP_NUM_NODES=2, SLURM_NODEID=0" in outs[0]
    assert f"127.0.0.[1-2], SLURM_JOB_ID={job})" in outs[0]
    assert "node 1 of 2" in outs[1]
    assert (run / "logs" / "node1" / "config.json").is_file()  # node 1 left node 0's alone
    _assert_same_weights(one_node, run)


def pod_command() -> list[str]:
    """The container command of the example PyTorchJob (the same for master and workers)."""
    spec = yaml.safe_load(PYTORCHJOB.read_text())["spec"]["pytorchReplicaSpecs"]
    commands = [r["template"]["spec"]["containers"][0]["command"] for r in spec.values()]
    assert all(c == commands[0] for c in commands), commands
    return [str(w) for w in commands[0]]


def test_two_pytorchjob_pods_train_as_one_node(one_node: Path, tmp_path: Path) -> None:
    port = _free_port()
    words = pod_command()
    argvs, envs = [], []
    for rank in range(2):
        # what the training operator sets in each pod (no nprocPerNode: one process a pod)
        envs.append(
            {
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "WORLD_SIZE": "2",
                "RANK": str(rank),
                "PYTHONUNBUFFERED": "0",
            }
        )
        argvs.append(_argv([*words, *TINY, "--nproc-per-node", "1"]))
    outs = _run_nodes(argvs, envs, tmp_path)
    assert "node 0 of 2 (PyTorchJob: WORLD_SIZE=2, RANK=0" in outs[0]
    run_dir = words[words.index("--run-dir") + 1]
    _assert_same_weights(one_node, tmp_path / run_dir)


def test_under_torchrun_it_trains_once_not_nested(one_node: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    (out,) = _run_nodes(
        [
            [
                *torchrun,
                "--nproc-per-node",
                "2",
                "-m",
                "syncline.cli.main",
                "train",
                *TINY,
                "--run-dir",
                str(run),
            ]
        ],
        [{}],
        tmp_path,
    )
    assert out.count("started by torchrun: training in this process") == 1, out
    assert out.count("syncline train: gpt on stdlib, 2 rank(s)") == 1  # rank 0 alone
    assert out.count("\nsummary:") == 1
    assert not (run / "logs").exists()  # no torchrun of its own: nothing launched again
    _assert_same_weights(one_node, run)


def test_a_flag_that_disagrees_with_srun_is_refused(tmp_path: Path) -> None:
    res = subprocess.run(
        [*SYNCLINE, "train", "--nnodes", "3", *TINY, "--run-dir", str(tmp_path / "r")],
        env={**_clean_env(), **srun_env(0, 2, 7)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2
    assert res.stderr.strip() == (
        "syncline train: error: --nnodes 3 disagrees with Slurm's SLURM_STEP_NUM_NODES=2 "
        "(nnodes=2); give the same value or leave --nnodes out"
    )
