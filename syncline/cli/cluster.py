"""``syncline train`` where a cluster started it: the node's place read from Slurm's, a
PyTorchJob pod's or torchrun's environment (:mod:`syncline.launch.clusters`), checked against
the flags given, and, under torchrun, training in this process instead of launching again.
"""

from __future__ import annotations

from typing import Any

from syncline.errors import ConfigError
from syncline.launch.clusters import Placement
from syncline.launch.devices import resolved_backend
from syncline.train.config import TrainConfig

__all__ = ["apply_placement", "train_here"]


def apply_placement(
    values: dict[str, Any], placement: Placement, backend: str, gpus: int, model: str
) -> None:
    """Fill ``values`` (the options given, by field name) with what ``placement`` fixes.

    A flag given as well must say the same; ``SLURM_GPUS_ON_NODE`` sets the ranks per node
    only when they train on GPUs (``backend`` resolves to NCCL). Under torchrun, a run
    directory not given is named after torchrun's run id, so that every worker names the
    same one.

    Raises:
        ConfigError: a flag that disagrees with the environment, naming both values; under
            torchrun with no run id (static rendezvous) and no ``--run-dir``; options that
            launch by themselves.
    """
    fixed = placement.values()
    if placement.gpus_only and resolved_backend(backend, gpus) != "nccl":
        fixed.pop("nproc_per_node", None)
    for key, value in fixed.items():
        given = values.get(key)
        if given is not None and given != value:
            flag = "--" + key.replace("_", "-")
            raise ConfigError(
                f"{flag} {given} disagrees with {placement.source}'s "
                f"{placement.origin[key]} ({key}={value!r}); give the same value or leave "
                f"{flag} out"
            )
        values[key] = value
    if placement.nnodes > 1 and not 0 <= placement.node_rank < placement.nnodes:
        raise ConfigError(
            f"{placement.origin['node_rank']} is not below {placement.origin['nnodes']}"
        )
    if placement.source != "torchrun":
        return
    if values.get("emulate_network") is not None:
        raise ConfigError(
            "--emulate-network starts its own nodes; run it outside torchrun "
            "(syncline train starts torchrun itself)"
        )
    if "run_dir" not in values:
        if placement.run_id in (None, "", "none"):
            raise ConfigError(
                "under torchrun every worker must write to one run directory, and torchrun "
                "gave no run id to name it by (static rendezvous): give --run-dir"
            )
        values["run_dir"] = f"runs/{placement.run_id}-{model}"


def train_here(cfg: TrainConfig, placement: Placement) -> int:
    """Train as one of the workers torchrun started (never a second launch): rank 0 of the
    first attempt prepares the run directory before it joins the rendezvous, which the
    others wait at, so none of them writes into it earlier; every rank then trains with the
    config it validated itself."""
    from syncline.train.preflight import prepare_run_dir
    from syncline.train.worker import run_worker

    if placement.rank == 0 and placement.attempt == 0:  # a restart resumes from its files
        prepare_run_dir(cfg)
    return run_worker(cfg)
