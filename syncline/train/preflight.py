"""PURE at import: the checks of a run that read the user's files or import the user's code.

Kept out of :class:`~syncline.train.config.TrainConfig`'s own validation, which is cheap and
pure (it runs again in every rank); ``syncline train`` runs these once, before any process
starts, so a bad path, an empty folder, unreadable data, a factory that fails or returns no
module, or split points that name no module end the command with one line.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from syncline.data.registry import check_data
from syncline.errors import ConfigError
from syncline.models.factory import FactoryCall
from syncline.train.config import TrainConfig

__all__ = ["check_run", "preflight", "prepare_node", "prepare_run_dir"]


def check_run(cfg: TrainConfig) -> TrainConfig:
    """Every check a run passes before any process starts, after the config's own: the
    compressor spec's value ranges (the compressor's to check) and :func:`preflight`. The one
    validation pass of ``syncline train`` (and of :func:`syncline.testing.run_training`): a
    combination the runtime cannot train is refused here, in one line, or not at all.

    Raises:
        ConfigError: naming the bad value or the conflicting options, and what is valid.
    """
    from syncline.dp.registry import build_compressor

    build_compressor(cfg.dp.compression)
    preflight(cfg)
    return cfg


def prepare_run_dir(cfg: TrainConfig) -> Path:
    """Make the run directory a launch starts from: a fresh run (no ``resume``) finds no
    metrics or checkpoints of an earlier run there (a restarted worker resumes from the
    newest checkpoint it finds, and one left by an earlier run must not be it); the config
    is written as ``config.json``, which every worker reads."""
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if cfg.checkpoint.resume is None:
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    (run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    return run_dir


def prepare_node(cfg: TrainConfig) -> tuple[Path, Path]:
    """The config file this node's workers read and the directory for its torchrun logs.

    Node 0 prepares the run directory (:func:`prepare_run_dir`). The nodes of a multi-node
    run usually share the run directory on a shared file system, so the others neither clear
    it nor write node 0's files (it may be reading them): each writes its own config, and
    keeps its logs, under ``logs/nodeN/`` (torchrun names its log folders by local rank,
    the same on every node).
    """
    if cfg.node_rank == 0:
        run_dir = prepare_run_dir(cfg)
        return run_dir / "config.json", run_dir / "logs"
    node_dir = Path(cfg.run_dir) / "logs" / f"node{cfg.node_rank}"
    node_dir.mkdir(parents=True, exist_ok=True)
    (node_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    return node_dir / "config.json", node_dir


def preflight(cfg: TrainConfig) -> None:
    """Check the data set (:func:`~syncline.data.registry.check_data`), a factory's model
    (:func:`~syncline.models.user.check_user_model`, built on the meta device) and that the
    optimizer's state checkpoints exactly (:func:`~syncline.train.optim_state.dry_check`).

    Raises:
        ConfigError: naming the value and what is valid.
    """
    check_data(cfg.dataset, cfg.seq_len, cfg.val_fraction)
    call = cfg.model_config()
    if cfg.dataset.startswith("tokens:"):  # the model's embedding must cover every id
        from syncline.data.folders import load_tokenizer

        size = load_tokenizer(cfg.dataset.removeprefix("tokens:")).get_vocab_size()
        vocab = getattr(call, "vocab_size", None)  # a factory's: only if given as an option
        if isinstance(call, FactoryCall):
            vocab = call.options.get("vocab_size")
        if isinstance(vocab, int) and vocab < size:
            raise ConfigError(
                f"data={cfg.dataset!r}: the tokenizer has {size} token ids but the model's "
                f"vocab_size is {vocab}; valid: --model-option vocab_size={size} (or more)"
            )
    if isinstance(call, FactoryCall):  # nothing is known of a factory's model until built
        from syncline.models.user import check_user_model

        check_user_model(call, cfg.pipeline.split_points)
    _check_optimizer(cfg)


def _check_optimizer(cfg: TrainConfig) -> None:
    """The optimizer's state must checkpoint exactly (every run writes ``checkpoint.pt``):
    one step on stand-in parameters shows its types before any process starts, not at the
    first checkpoint after hours of training."""
    from syncline.errors import CheckpointError
    from syncline.train.common import make_optimizer
    from syncline.train.optim_state import dry_check

    try:
        dry_check(lambda params: make_optimizer(cfg, params))
    except CheckpointError as exc:
        raise ConfigError(f"optimizer={cfg.optim.optimizer!r}: {exc}") from None
