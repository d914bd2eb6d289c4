"""Run ``syncline train``'s per-rank code in-process: the trainer under :func:`run_ranks`.

``syncline train`` validates the config once, writes the run directory and launches
torchrun, whose workers each run :func:`syncline.train.worker.run_rank`. Tests of the
trainer (not of the launcher) need none of torchrun's fixed cost (~7 s a launch): here the
same validation runs in the caller, and the same ``run_rank`` on ranks forked by
:func:`~syncline.testing.harness.run_ranks`, each with a real gloo group.

Example:
    >>> cfg = check_run(TrainConfig(steps=2, run_dir=str(tmp)))  # doctest: +SKIP
    >>> summaries = run_training(cfg)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

from syncline.testing.harness import run_ranks
from syncline.train.config import TrainConfig

__all__ = ["run_training"]


def _training_rank(rank: int, world: int, values: dict[str, Any], attempt: int) -> Any:
    import torch

    from syncline.registry import import_plugins
    from syncline.train.common import rank_backend_and_device
    from syncline.train.worker import run_rank

    import_plugins(values.get("plugins", ()))
    cfg = TrainConfig.from_dict(values)
    torch.set_num_threads(cfg.threads)
    _, device = rank_backend_and_device(cfg, rank)
    per_node = cfg.dp.ranks_per_node or world
    return run_rank(cfg, rank, world, device, ranks_per_node=per_node, attempt=attempt)


def run_training(
    cfg: TrainConfig, *, attempt: int = 0, timeout_s: float = 300.0, prepare: bool = True
) -> list[dict[str, Any]]:
    """Train ``cfg`` on ``cfg.world_size`` local gloo ranks; each rank's summary (complete
    on rank 0).

    ``attempt`` > 0 is a worker restarted by torchrun's ``--max-restarts``: it resumes from
    the run directory's newest checkpoint by itself (``prepare`` must then be False, as a
    restart does not clear the directory).

    Raises:
        RankFailure: naming the first rank that raised, died or did not finish in time.
    """
    if prepare:
        from syncline.train.preflight import prepare_run_dir

        prepare_run_dir(cfg)
    return run_ranks(
        _training_rank,
        cfg.world_size,
        cfg.to_dict(),
        attempt,
        timeout_s=timeout_s,
        threads=cfg.threads,
        comm_timeout_s=cfg.timeout_s,
    )
