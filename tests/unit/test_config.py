"""TrainConfig and DataParallelConfig reject nonsense with messages that name the value."""

from __future__ import annotations

import pytest

from syncline.config import DataParallelConfig, TrainConfig
from syncline.errors import ConfigError
from syncline.train.trainer import lr_at


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"model": "resnet9000"}, "unknown model 'resnet9000'; valid: gpt, cnn"),
        ({"data": "imagenet"}, "data='imagenet' does not fit model 'gpt'"),
        ({"batch_size": 0}, "batch_size=0 must be a positive integer"),
        ({"steps": -3}, "steps=-3"),
        ({"batch_size": 30, "nproc_per_node": 4}, "batch_size=30 is not divisible"),
        ({"lr": 0.0}, "lr=0.0 must be > 0"),
        ({"n_embd": 100, "n_head": 3}, "n_embd=100 must be divisible by n_head=3"),
        ({"nnodes": 2}, "needs --rdzv-endpoint"),
        ({"node_rank": 3}, "node_rank=3"),
        ({"optimizer": "lion"}, "optimizer='lion'"),
        ({"inject_failure": "x"}, "RANK:STEP"),
        ({"inject_failure": "5:1"}, "rank must be in"),
    ],
)
def test_train_config_errors(kwargs, match) -> None:
    with pytest.raises(ConfigError, match=match.replace("(", r"\(")):
        TrainConfig(**kwargs)


def test_round_trip_and_unknown_keys() -> None:
    cfg = TrainConfig(model="cnn", batch_size=64)
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="unknown config keys"):
        TrainConfig.from_dict({"bogus": 1})


@pytest.mark.parametrize("field", ["bucket_cap_mb", "first_bucket_cap_mb", "timeout_s"])
def test_dp_config_errors(field) -> None:
    with pytest.raises(ConfigError, match=f"{field}=-1"):
        DataParallelConfig(**{field: -1})


def test_lr_schedule_warms_up_then_decays() -> None:
    cfg = TrainConfig(lr=1.0, warmup_steps=10, steps=110)
    assert lr_at(cfg, 0) == pytest.approx(0.1)
    assert lr_at(cfg, 9) == pytest.approx(1.0)
    assert lr_at(cfg, 10) == pytest.approx(1.0)
    assert lr_at(cfg, 109) == pytest.approx(0.1, abs=1e-3)
