"""Where a node learns its place in a job from what started it: Slurm's ``srun``, a Kubeflow
PyTorchJob pod, or ``torchrun`` itself (then this process is already a worker).

Clusters do not type ``--nnodes``, ``--node-rank`` and ``--rdzv-endpoint`` on every node;
their scheduler sets variables in each task's environment. :func:`detect` reads them into a
:class:`Placement` (pure data; the command line compares it with the flags given and refuses a
disagreement). Only this launch layer and the command line read the environment.

What is read, by source:

- **torchrun worker** (``TORCHELASTIC_RUN_ID`` and ``LOCAL_RANK`` set, as torchrun does for
  the processes it starts): ``GROUP_WORLD_SIZE`` nodes, ``GROUP_RANK``, ``LOCAL_WORLD_SIZE``
  ranks per node, ``MASTER_ADDR:MASTER_PORT``. ``syncline train`` then trains in this process.
- **Slurm** (``SLURM_NODEID`` and a node list set, as ``srun`` does in each task): the nodes
  from ``SLURM_STEP_NUM_NODES``, ``SLURM_NNODES`` or ``SLURM_JOB_NUM_NODES``, this node from
  ``SLURM_NODEID``, the rendezvous on the first host of ``SLURM_STEP_NODELIST``,
  ``SLURM_NODELIST`` or ``SLURM_JOB_NODELIST`` (expanded here, no ``scontrol``), or
  ``MASTER_ADDR`` where the job script exports one, at ``MASTER_PORT`` or else
  ``20000 + SLURM_JOB_ID % 20000`` (one port per job, the same on every node); ranks per node:
  ``SLURM_GPUS_ON_NODE`` when the ranks train on GPUs. One task per node: ``syncline train``
  starts the node's ranks itself, so more tasks per node (``SLURM_NTASKS_PER_NODE``, or
  ``SLURM_STEP_NUM_TASKS`` over ``SLURM_STEP_NUM_NODES``) are refused.
- **PyTorchJob** (Kubeflow's training operator): with ``nprocPerNode`` the operator sets
  torchrun's own ``PET_NNODES``, ``PET_NODE_RANK``, ``PET_NPROC_PER_NODE`` and
  ``PET_MASTER_ADDR``/``PET_MASTER_PORT``, read first; without it, ``MASTER_ADDR``,
  ``MASTER_PORT``, and ``WORLD_SIZE``/``RANK`` counting pods (one pod per node).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from syncline.errors import ConfigError

__all__ = ["Placement", "detect", "expand_nodelist", "first_host"]


@dataclass(frozen=True)
class Placement:
    """This node's part of a job, as its environment states it.

    Attributes:
        source: ``"Slurm"``, ``"PyTorchJob"`` or ``"torchrun"`` (already a worker).
        nnodes: nodes in the job.
        node_rank: this node's index, ``0..nnodes-1``.
        rdzv_endpoint: ``HOST:PORT`` of node 0's rendezvous.
        nproc_per_node: ranks per node, where the environment says (``None``: it does not).
        gpus_only: ``nproc_per_node`` counts GPUs (Slurm's ``SLURM_GPUS_ON_NODE``), so it
            applies only to ranks that train on GPUs.
        origin: option name -> the ``VARIABLE=value`` it came from, for messages.
        rank: under torchrun, this worker's global rank (``RANK``); else ``None``.
        run_id: under torchrun, its run id (``TORCHELASTIC_RUN_ID``; ``"none"`` for a
            static rendezvous).
        attempt: under torchrun, its restart count (``TORCHELASTIC_RESTART_COUNT``).
    """

    source: str
    nnodes: int
    node_rank: int
    rdzv_endpoint: str
    nproc_per_node: int | None = None
    gpus_only: bool = False
    origin: dict[str, str] = field(default_factory=dict)
    rank: int | None = None
    run_id: str | None = None
    attempt: int = 0

    def values(self) -> dict[str, object]:
        """The launch options this placement fixes, by ``TrainConfig`` field name."""
        out: dict[str, object] = {
            "nnodes": self.nnodes,
            "node_rank": self.node_rank,
            "rdzv_endpoint": self.rdzv_endpoint,
        }
        if self.nproc_per_node is not None:
            out["nproc_per_node"] = self.nproc_per_node
        return out


_GROUP = re.compile(r"\[([^\[\]]*)\]")


def expand_nodelist(text: str) -> list[str]:
    """The hosts of a Slurm node list, in order, as ``scontrol show hostnames`` prints them.

    Commas outside brackets separate hosts; a bracket holds comma-separated numbers and
    ``a-b`` ranges whose zero padding is kept; several brackets in one name multiply.

    Example:
        >>> expand_nodelist("node[01-03,07],gpu-a[1-2]x")
        ['node01', 'node02', 'node03', 'node07', 'gpu-a1x', 'gpu-a2x']

    Raises:
        ConfigError: an empty list, an unbalanced bracket or a range that runs backwards.
    """
    hosts: list[str] = []
    for item in _split_top(text):
        names = [""]
        rest = item
        while rest:
            match = _GROUP.search(rest)
            if match is None:
                if "[" in rest or "]" in rest:
                    raise ConfigError(f"node list {text!r}: unbalanced bracket in {item!r}")
                names = [n + rest for n in names]
                break
            prefix = rest[: match.start()]
            if "[" in prefix or "]" in prefix:
                raise ConfigError(f"node list {text!r}: unbalanced bracket in {item!r}")
            names = [n + prefix + s for n in names for s in _expand_group(text, match.group(1))]
            rest = rest[match.end() :]
        hosts += names
    if not hosts:
        raise ConfigError(f"node list {text!r} names no host")
    return hosts


def _split_top(text: str) -> list[str]:
    """``text`` split at the commas outside brackets (empty items dropped)."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "["
        depth -= ch == "]"
        if depth < 0 or depth > 1:
            raise ConfigError(f"node list {text!r}: unbalanced bracket")
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise ConfigError(f"node list {text!r}: unbalanced bracket")
    items.append(text[start:])
    return [s.strip() for s in items if s.strip()]


def _expand_group(text: str, body: str) -> list[str]:
    """The suffixes of one bracket: ``01-03,07`` -> ``01 02 03 07``."""
    out: list[str] = []
    for part in body.split(","):
        low, dash, high = part.strip().partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ConfigError(f"node list {text!r}: {part!r} is no number or range a-b")
        if not dash:
            out.append(low)
            continue
        if int(high) < int(low):
            raise ConfigError(f"node list {text!r}: range {part!r} runs backwards")
        out += [str(n).zfill(len(low)) for n in range(int(low), int(high) + 1)]
    return out


def first_host(text: str) -> str:
    """The first host of a Slurm node list: node 0, where the rendezvous runs.

    Example:
        >>> first_host("node[01-04,07]")
        'node01'
    """
    return expand_nodelist(text)[0]


def detect(environ: Mapping[str, str] | None = None) -> Placement | None:
    """This node's placement from ``environ`` (default: ``os.environ``), or ``None`` where
    nothing started it but the user (then the flags alone say).

    Raises:
        ConfigError: variables that contradict each other or are no integers, or a Slurm
            step with more than one task per node.
    """
    env = os.environ if environ is None else environ
    for read in (_torchrun_worker, _slurm, _pytorchjob):
        placement = read(env)
        if placement is not None:
            return placement
    return None


def _first(env: Mapping[str, str], *names: str) -> tuple[str, str] | None:
    """``(name, value)`` of the first of ``names`` set (non-empty) in ``env``."""
    for name in names:
        if env.get(name, "").strip():
            return name, env[name].strip()
    return None


def _int(env: Mapping[str, str], *names: str, low: int = 0) -> tuple[str, int] | None:
    """The first of ``names`` set, as an integer of at least ``low``."""
    found = _first(env, *names)
    if found is None:
        return None
    name, text = found
    if not text.lstrip("-").isdigit() or int(text) < low:
        raise ConfigError(f"{name}={text!r} in the environment is not an integer >= {low}")
    return name, int(text)


def _torchrun_worker(env: Mapping[str, str]) -> Placement | None:
    if "TORCHELASTIC_RUN_ID" not in env or "LOCAL_RANK" not in env:
        return None
    world, local = _int(env, "WORLD_SIZE", low=1), _int(env, "LOCAL_WORLD_SIZE", low=1)
    group, rank = _int(env, "GROUP_RANK"), _int(env, "RANK")
    attempt = _int(env, "TORCHELASTIC_RESTART_COUNT")
    addr, port = _first(env, "MASTER_ADDR"), _first(env, "MASTER_PORT")
    if None in (world, local, group, rank, addr, port) or not (world and local and group):
        raise ConfigError(
            "TORCHELASTIC_RUN_ID and LOCAL_RANK are set (a torchrun worker) but not all of "
            "RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT"
        )
    assert rank is not None and addr is not None and port is not None
    nodes = _int(env, "GROUP_WORLD_SIZE", low=1)
    nnodes = nodes[1] if nodes else world[1] // local[1]
    if nnodes * local[1] != world[1]:
        raise ConfigError(
            f"WORLD_SIZE={world[1]} is not GROUP_WORLD_SIZE={nnodes} x LOCAL_WORLD_SIZE="
            f"{local[1]}: every node must run as many ranks (torchrun --nproc-per-node)"
        )
    return Placement(
        "torchrun",
        nnodes,
        group[1],
        f"{addr[1]}:{port[1]}",
        local[1],
        origin={
            "nnodes": f"GROUP_WORLD_SIZE={nnodes}" if nodes else f"WORLD_SIZE={world[1]}",
            "node_rank": f"GROUP_RANK={group[1]}",
            "rdzv_endpoint": f"MASTER_ADDR={addr[1]}, MASTER_PORT={port[1]}",
            "nproc_per_node": f"LOCAL_WORLD_SIZE={local[1]}",
        },
        rank=rank[1],
        run_id=env["TORCHELASTIC_RUN_ID"],
        attempt=attempt[1] if attempt else 0,
    )


def _slurm(env: Mapping[str, str]) -> Placement | None:
    nodelist = _first(env, "SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST")
    node = _int(env, "SLURM_NODEID")
    if nodelist is None or node is None:
        return None
    hosts = expand_nodelist(nodelist[1])
    counted = _int(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES", low=1)
    nnodes = counted[1] if counted else len(hosts)
    if nnodes != len(hosts):
        raise ConfigError(
            f"{counted[0] if counted else 'SLURM_NNODES'}={nnodes} but {nodelist[0]}="
            f"{nodelist[1]} names {len(hosts)} host(s)"
        )
    _one_task_per_node(env)
    addr = _first(env, "MASTER_ADDR")
    port = _int(env, "MASTER_PORT", low=1)
    job = _int(env, "SLURM_JOB_ID", "SLURM_JOBID")
    port_value = port[1] if port else 20000 + (job[1] if job else 0) % 20000
    host = addr[1] if addr else hosts[0]
    gpus = _int(env, "SLURM_GPUS_ON_NODE")
    said_host = f"MASTER_ADDR={host}" if addr else f"{nodelist[0]}={nodelist[1]}"
    said_port = f"MASTER_PORT={port_value}" if port else f"SLURM_JOB_ID={job[1] if job else '?'}"
    origin = {
        "nnodes": f"{counted[0]}={nnodes}" if counted else f"{nodelist[0]}={nodelist[1]}",
        "node_rank": f"SLURM_NODEID={node[1]}",
        "rdzv_endpoint": f"{said_host}, {said_port}",
    }
    if gpus and gpus[1] > 0:
        origin["nproc_per_node"] = f"SLURM_GPUS_ON_NODE={gpus[1]}"
    return Placement(
        "Slurm",
        nnodes,
        node[1],
        f"{host}:{port_value}",
        gpus[1] if gpus and gpus[1] > 0 else None,
        gpus_only=True,
        origin=origin,
    )


def _one_task_per_node(env: Mapping[str, str]) -> None:
    """Refuse a step with several tasks per node: each would start the node's ranks."""
    tasks, nodes = _int(env, "SLURM_STEP_NUM_TASKS", low=1), _int(env, "SLURM_STEP_NUM_NODES")
    per_node = _int(env, "SLURM_NTASKS_PER_NODE", low=1)
    if tasks and nodes and tasks[1] > nodes[1]:
        said = f"SLURM_STEP_NUM_TASKS={tasks[1]} on SLURM_STEP_NUM_NODES={nodes[1]}"
    elif not (tasks and nodes) and per_node and per_node[1] > 1:
        said = f"SLURM_NTASKS_PER_NODE={per_node[1]}"
    else:
        return
    raise ConfigError(
        f"srun started more than one task per node ({said}); syncline train starts a node's "
        "ranks itself (one per GPU, or --nproc-per-node): run one task per node "
        "(#SBATCH --ntasks-per-node=1, or srun --ntasks-per-node=1)"
    )


def _pytorchjob(env: Mapping[str, str]) -> Placement | None:
    if _first(env, "PET_NNODES") is not None:
        nnodes_text = env["PET_NNODES"].strip()
        if ":" in nnodes_text:  # an elastic range: torchrun's c10d rendezvous, not ours
            raise ConfigError(
                f"PET_NNODES={nnodes_text!r} is an elastic range; syncline train joins a fixed "
                "number of nodes: give the PyTorchJob no elasticPolicy"
            )
        nnodes, rank = _int(env, "PET_NNODES", low=1), _int(env, "PET_NODE_RANK")
        addr = _first(env, "PET_MASTER_ADDR", "MASTER_ADDR")
        port = _first(env, "PET_MASTER_PORT", "MASTER_PORT")
        procs = _first(env, "PET_NPROC_PER_NODE")
        nproc = _int(env, "PET_NPROC_PER_NODE", low=1) if procs and procs[1].isdigit() else None
    else:
        nnodes, rank = _int(env, "WORLD_SIZE", low=1), _int(env, "RANK")
        addr, port, nproc = _first(env, "MASTER_ADDR"), _first(env, "MASTER_PORT"), None
        if nnodes is None or rank is None or addr is None or port is None:
            return None
    if nnodes is None or rank is None or addr is None or port is None:
        raise ConfigError(
            "PET_NNODES is set (a PyTorchJob with nprocPerNode) but not all of PET_NODE_RANK, "
            "PET_MASTER_ADDR or MASTER_ADDR, PET_MASTER_PORT or MASTER_PORT"
        )
    origin = {
        "nnodes": f"{nnodes[0]}={nnodes[1]}",
        "node_rank": f"{rank[0]}={rank[1]}",
        "rdzv_endpoint": f"{addr[0]}={addr[1]}, {port[0]}={port[1]}",
    }
    if nproc is not None:
        origin["nproc_per_node"] = f"PET_NPROC_PER_NODE={nproc[1]}"
    return Placement(
        "PyTorchJob",
        nnodes[1],
        rank[1],
        f"{addr[1]}:{port[1]}",
        nproc[1] if nproc else None,
        origin=origin,
    )
