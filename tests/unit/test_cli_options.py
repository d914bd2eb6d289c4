"""The command line is generated from the configs: every field documented once, every field a
flag, defaults and choices taken from the code and the registries (so they cannot drift)."""

from __future__ import annotations

import dataclasses

import pytest

from syncline.cli.main import build_parser, config_from_args
from syncline.dp.config import DataParallelConfig, DataParallelSettings
from syncline.errors import ConfigError
from syncline.fields import cli_option, field_docs, leaves
from syncline.models.configs import CNNConfig, GPTConfig
from syncline.optim.config import OptimConfig
from syncline.pipeline.config import PipelineConfig, PipelineSettings
from syncline.schedule import SCHEDULES, ScheduleSpec, gpipe
from syncline.train.checkpoint_config import CheckpointConfig
from syncline.train.config import TrainConfig

CONFIGS = [DataParallelConfig, PipelineConfig, TrainConfig, GPTConfig, CNNConfig]
CONFIGS += [DataParallelSettings, PipelineSettings, OptimConfig, CheckpointConfig]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.__name__)
def test_every_config_field_has_its_docstring(config: type) -> None:
    docs = field_docs(config)
    missing = [f.name for f in dataclasses.fields(config) if not docs.get(f.name)]
    assert missing == []


def _train_help() -> str:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices["train"].format_help()  # type: ignore[union-attr]


def test_every_train_config_field_is_a_flag_with_its_default_and_doc() -> None:
    text = " ".join(_train_help().split())
    for leaf in leaves(TrainConfig):  # the parts' fields too: each setting is a flag
        f = leaf.field
        opt = cli_option(f)
        flag = (opt.flags or (f"--{f.name.replace('_', '-')}",))[0]
        assert flag in text, flag
        default = opt.default_text or str(f.default)
        assert f"(default: {default})" in text, (f.name, default)
    assert "Optimizer steps. (default: 300)" in text  # --steps: from the field, not a copy


# the sections of ``syncline train --help`` and their flags, in the order a user reads them
HELP_SECTIONS = [
    ("options", ["-h", "--plan", "--plan-cluster"]),
    ("model and data", ["--model", "--data", "--model-option", "--seq-len", "--n-layer",
                        "--n-embd", "--n-head", "--cnn-width"]),
    ("optimisation", ["--batch-size", "--steps", "--lr", "--lr-scaling", "--base-batch-size",
                      "--optimizer", "--precision", "--momentum", "--weight-decay",
                      "--warmup-steps", "--seed"]),
    ("data parallelism", ["--bucket-cap-mb", "--first-bucket-cap-mb", "--timeout",
                          "--compression", "--allreduce", "--ranks-per-node", "--sync"]),
    ("pipeline parallelism", ["--pipeline-stages", "--microbatches", "--schedule",
                              "--recompute", "--balance", "--split-points"]),
    ("launch (passed to torchrun)", ["--nproc-per-node", "--nnodes", "--node-rank",
                                     "--rdzv-endpoint", "--backend", "--threads",
                                     "--emulate-network", "--plugin"]),
    ("output", ["--run-dir", "--log-every", "--tensorboard", "--inject-failure"]),
    ("validation", ["--val-fraction", "--eval-every", "--eval-batches", "--sample-tokens"]),
    ("checkpoints and failures", ["--checkpoint-every", "--keep-checkpoints", "--resume",
                                  "--on-checkpoint-error", "--max-restarts"]),
    ("non-finite values and loss spikes", ["--on-nonfinite", "--skip-batches",
                                           "--spike-factor", "--spike-window",
                                           "--inject-nonfinite"]),
]  # fmt: skip


def test_help_lists_the_composed_settings_in_the_sections_and_order_users_know() -> None:
    """The settings live in their owners' parts; ``--help`` shows them as it always has."""
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    train = sub.choices["train"]  # type: ignore[index]
    shown = [
        (g.title, [a.option_strings[0] for a in g._group_actions])
        for g in train._action_groups
        if g._group_actions
    ]
    assert shown == HELP_SECTIONS


def test_registered_schedule_appears_in_help_and_is_accepted() -> None:
    spec = ScheduleSpec(
        "help-test", "a schedule", generate=lambda d, m, c, r: gpipe(d, m, recompute=r)
    )
    SCHEDULES.register(spec)
    try:
        assert "gpipe, 1f1b, 2bw, interleaved, help-test" in " ".join(_train_help().split())
        ns = build_parser().parse_args(
            ["train", "--pipeline-stages", "2", "--schedule", "help-test", "--run-dir", "x"]
        )
        assert config_from_args(ns).pipeline.schedule == "help-test"
    finally:
        SCHEDULES.unregister("help-test")
    with pytest.raises(ConfigError, match="schedule='help-test' is unknown"):
        config_from_args(ns)


def test_model_flags_and_model_options_reach_the_model_config() -> None:
    ns = build_parser().parse_args(
        ["train", "--n-layer", "3", "--model-option", "dropout=0.1", "--run-dir", "x"]
    )
    cfg = config_from_args(ns)
    assert cfg.model_options == {"n_layer": 3, "dropout": 0.1}
    assert (cfg.model_config().n_layer, cfg.model_config().dropout) == (3, 0.1)
    assert cfg.model_config().block_size == cfg.seq_len  # the GPT's context follows --seq-len
