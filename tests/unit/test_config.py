"""TrainConfig, its parts and DataParallelConfig reject nonsense with messages naming the value."""

from __future__ import annotations

import json
import re

import pytest
import torch

from syncline.dp.config import DataParallelConfig
from syncline.errors import ConfigError
from syncline.models import build_model
from syncline.train.config import TrainConfig
from syncline.train.trainer import lr_at
from tests.zoo.ids import kwargs_id

# (TrainConfig keyword arguments, what the ConfigError says)
TRAIN_ERRORS = [
    ({"model": "resnet9000"}, "model='resnet9000' is unknown; valid: gpt, cnn"),
    ({"data": "imagenet"}, "data='imagenet' does not fit model 'gpt'"),
    ({"batch_size": 0}, "batch_size=0 is invalid; valid: an integer >= 1"),
    ({"steps": -3}, "steps=-3"),
    ({"batch_size": 30, "nproc_per_node": 4}, "batch_size=30 is not divisible"),
    ({"lr": 0.0}, "lr=0.0 is invalid; valid: a finite number > 0"),
    ({"lr": float("inf")}, "lr=inf is invalid; valid: a finite number > 0"),
    ({"weight_decay": float("nan")}, "weight_decay=nan is invalid; valid: a finite number >= 0"),
    ({"warmup_steps": -1}, "warmup_steps=-1 is invalid; valid: an integer >= 0"),
    (
        {"model_options": {"n_embd": 100, "n_head": 3}},
        "n_embd=100 is not divisible by n_head=3",
    ),
    ({"model_options": {"n_layers": 2}}, "unknown option 'n_layers' for model 'gpt'"),
    ({"model_options": {"n_layer": "two"}}, "n_layer='two' of model 'gpt' is not a valid int"),
    ({"nnodes": 2}, "needs --rdzv-endpoint"),
    ({"node_rank": 3}, "node_rank=3"),
    ({"optimizer": "lion"}, "optimizer='lion'"),
    ({"inject_failure": "x"}, "RANK:STEP"),
    ({"inject_failure": "5:1"}, "rank must be in"),
    ({"val_fraction": 0.7}, "val_fraction=0.7 is invalid; valid: a number in"),
    ({"eval_every": -1}, "eval_every=-1 is invalid"),
    ({"val_fraction": 0.0}, "eval_every=100 needs held-out data but val_fraction=0"),
    ({"eval_batches": 0}, "eval_batches=0 is invalid; valid: an integer >= 1"),
    ({"compression": "csc:0.01"}, "applies momentum itself"),
    ({"compression": "csc:0.01", "optimizer": "lamb"}, "momentum twice"),
    ({"precision": "fp8"}, "precision='fp8' is unknown; valid: fp32, bf16, fp16"),
]


@pytest.mark.parametrize(
    ("kwargs", "match"), TRAIN_ERRORS, ids=[kwargs_id(k) for k, _ in TRAIN_ERRORS]
)
def test_train_config_errors(kwargs, match) -> None:
    with pytest.raises(ConfigError, match=match.replace("(", r"\(")):
        TrainConfig.from_flat(**kwargs)


def test_round_trip_and_unknown_keys() -> None:
    cfg = TrainConfig(model="cnn", batch_size=64)
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="unknown config keys"):
        TrainConfig.from_dict({"bogus": 1})
    with pytest.raises(ConfigError, match=r"unknown config keys \['bogus'\]; valid: .*'lr'"):
        TrainConfig.from_flat(bogus=1)
    with pytest.raises(ConfigError, match=r"unknown config keys \['bogus'\]"):
        TrainConfig.from_dict({"optim": {"bogus": 1}})
    with pytest.raises(ConfigError, match="config key 'lr' is given twice"):
        TrainConfig.from_dict({"lr": 0.1, "optim": {"lr": 0.2}})
    with pytest.raises(
        ConfigError, match=r"optim=.* is invalid; valid: an instance of OptimConfig"
    ):
        TrainConfig(optim={"lr": 0.1})  # type: ignore[arg-type]


@pytest.mark.parametrize("field", ["bucket_cap_mb", "first_bucket_cap_mb", "timeout_s"])
def test_dp_config_errors(field) -> None:
    with pytest.raises(ConfigError, match=f"{field}=-1"):
        DataParallelConfig(**{field: -1})


def test_lr_schedule_warms_up_then_decays() -> None:
    cfg = TrainConfig.from_flat(lr=1.0, warmup_steps=10, steps=110)
    assert lr_at(cfg, 0) == pytest.approx(0.1)
    assert lr_at(cfg, 9) == pytest.approx(1.0)
    assert lr_at(cfg, 10) == pytest.approx(1.0)
    assert lr_at(cfg, 109) == pytest.approx(0.1, abs=1e-3)


PIPE = {"pipeline_stages": 2}


# (TrainConfig keyword arguments, what the ConfigError says)
PIPELINE_ERRORS = [
    ({"pipeline_stages": 0}, "pipeline_stages=0 is invalid; valid: an integer >= 1"),
    ({"pipeline_stages": 7}, "pipeline_stages=7 needs 7 stages but the gpt model has 6"),
    (
        {**PIPE, "model_options": {"n_layer": 1}, "schedule": "interleaved"},
        "needs 4 stages but the gpt model has 3",
    ),
    ({"model": "cnn", "pipeline_stages": 6, "nproc_per_node": 6}, "cnn model has 5 layers"),
    ({"pipeline_stages": 3}, "pipeline_stages=3 does not divide the 2 ranks"),
    (
        {**PIPE, "nproc_per_node": 4, "batch_size": 20},
        "batch_size=20 over 2 replica(s) does not split into microbatches=4",
    ),
    ({**PIPE, "batch_size": 30}, "batch_size=30 over 1 replica(s) does not split into micro"),
    ({**PIPE, "microbatches": 0}, "microbatches=0 is invalid; valid: an integer >= 1"),
    ({**PIPE, "schedule": "2bw", "microbatches": 1}, "microbatches=1 must be >= pipeline_st"),
    ({**PIPE, "schedule": "interleaved", "microbatches": 3, "batch_size": 6}, "multiple of"),
    ({**PIPE, "schedule": "zigzag"}, "schedule='zigzag' is unknown; valid: gpipe, 1f1b, 2bw"),
    ({**PIPE, "balance": (1, 1)}, "balance=[1, 1] sums to 2 layers but the module has 6"),
    ({**PIPE, "balance": (6,)}, "balance=[6] has 1 stages; valid: 2 entries"),
    ({**PIPE, "balance": (0, 6)}, "balance=[0, 6] is invalid"),
    ({**PIPE, "compression": "fp16"}, "compression='fp16' compresses the gradient allreduce"),
    ({"schedule": "gpipe"}, "need pipeline_stages > 1 (got pipeline_stages=1)"),
    ({"microbatches": 4}, "need pipeline_stages > 1"),
    ({"recompute": True}, "need pipeline_stages > 1"),
]


@pytest.mark.parametrize(
    ("kwargs", "match"), PIPELINE_ERRORS, ids=[kwargs_id(k) for k, _ in PIPELINE_ERRORS]
)
def test_pipeline_config_errors(kwargs, match) -> None:
    with pytest.raises(ConfigError, match=re.escape(match)):
        TrainConfig.from_flat(**kwargs)


def test_hierarchical_allreduce_combines_with_pipeline_replicas() -> None:
    cfg = TrainConfig.from_flat(**{**PIPE, "nproc_per_node": 4, "allreduce": "hierarchical"})
    assert cfg.dp.allreduce == "hierarchical" and cfg.pipeline_replicas == 2


def test_pipeline_defaults_resolve_on_creation_and_round_trip_through_json() -> None:
    cfg = TrainConfig.from_flat(pipeline_stages=2, balance=[1, 5])
    p = cfg.pipeline
    assert (p.schedule, p.microbatches, p.balance) == ("1f1b", 4, (1, 5))
    assert cfg.to_dict()["pipeline"]["balance"] == [1, 5]
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    interleaved = TrainConfig.from_flat(pipeline_stages=2, schedule="interleaved")
    assert interleaved.pipeline.virtual_stages == 4 and interleaved.pipeline_replicas == 1
    assert TrainConfig().pipeline.schedule is None and not TrainConfig().pipeline.pipelined


def test_model_layers_match_the_models_that_are_built() -> None:
    """The registry states the layer counts without building (no torch); they must be right."""
    assert len(build_model("cnn")) == 5 == TrainConfig(model="cnn").model_layers
    gpt = build_model("gpt", n_layer=3, n_embd=32)
    assert len(gpt) == TrainConfig(model_options={"n_layer": 3, "n_embd": 32}).model_layers


def test_csc_beside_adam_is_well_defined_without_its_momentum() -> None:
    for optimizer in ("adamw", "lamb"):
        cfg = TrainConfig.from_flat(compression="csc:0.01:momentum=0", optimizer=optimizer)
        assert cfg.optim.optimizer == optimizer and cfg.dp.owns_momentum
    for optimizer in ("sgd", "lars"):  # their momentum moves into CSC
        cfg = TrainConfig.from_flat(compression="csc:0.01", optimizer=optimizer)
        assert cfg.optim.optimizer == optimizer and cfg.dp.owns_momentum


@pytest.mark.parametrize(
    ("scaling", "base", "peak"),
    [("none", 32, 0.1), ("linear", 32, 0.8), ("sqrt", 32, 0.1 * 8**0.5), ("linear", None, 0.1)],
)
def test_the_peak_learning_rate_follows_the_batch(scaling, base, peak) -> None:
    cfg = TrainConfig.from_flat(lr=0.1, batch_size=256, lr_scaling=scaling, base_batch_size=base)
    assert cfg.peak_lr == pytest.approx(peak)
    assert lr_at(cfg, cfg.optim.warmup_steps - 1) == pytest.approx(peak)  # the end of warm-up
    with pytest.raises(ConfigError, match="lr_scaling='cubic' is not known"):
        TrainConfig.from_flat(lr_scaling="cubic")


@pytest.mark.parametrize("name", ["lars", "lamb", "sgd", "adamw"])
def test_each_optimizer_is_built_with_the_scaled_rate(name) -> None:
    from torch import nn

    from syncline.optim import Lamb, Lars
    from syncline.train.common import make_optimizer

    cfg = TrainConfig.from_flat(
        optimizer=name, lr=0.01, batch_size=64, base_batch_size=16, lr_scaling="linear"
    )
    opt = make_optimizer(cfg, list(nn.Linear(2, 2).parameters()))
    kinds = {"lars": Lars, "lamb": Lamb, "sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}
    assert type(opt) is kinds[name] and opt.param_groups[0]["lr"] == pytest.approx(0.04)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_is_accepted_with_pipelines(precision: str) -> None:
    cfg = TrainConfig.from_flat(precision=precision, pipeline_stages=2, nproc_per_node=2)
    assert cfg.precision == precision and cfg.pipeline.pipeline_stages == 2


def test_fp16_with_an_error_feedback_reduce_in_a_pipeline_is_accepted() -> None:
    """The REDUCE unscales each bucket before the compressor keeps any of it."""
    cfg = TrainConfig.from_flat(
        precision="fp16", compression="powersgd:2", pipeline_stages=2, nproc_per_node=4
    )
    assert cfg.precision == "fp16" and cfg.dp.compression == "powersgd:2"


def test_a_checkpoint_failure_needs_a_step_that_writes_one() -> None:
    """Checkpoints are written every ``checkpoint_every`` steps and after the last step: a
    failure injected into the checkpoint of any other step is refused, naming what is valid."""
    with pytest.raises(ConfigError, match="no checkpoint is written at step 2"):
        TrainConfig.from_flat(inject_failure="1:2:checkpoint", checkpoint_every=2, steps=9)
    for step in (1, 7, 8):  # after steps 2, 8 (every 2), and 9 (the last)
        cfg = TrainConfig.from_flat(
            inject_failure=f"1:{step}:checkpoint", checkpoint_every=2, steps=9
        )
        assert cfg.checkpoint_due(step + 1)
    assert not TrainConfig.from_flat(checkpoint_every=0, steps=9).checkpoint_due(9)


# config.json as syncline wrote it before the config was composed of parts: every setting at
# the top (a pipeline of 2 stages on 2 ranks, checkpointed every 4 steps)
FLAT_CONFIG_JSON = {
    "model": "gpt", "data": None, "model_options": {"n_layer": 2, "n_embd": 32}, "seq_len": 16,
    "batch_size": 16, "steps": 8, "lr": 0.01, "lr_scaling": "none", "base_batch_size": None,
    "optimizer": "adamw", "precision": "fp32", "momentum": 0.9, "weight_decay": 0.0,
    "warmup_steps": 20, "seed": 0, "bucket_cap_mb": None, "first_bucket_cap_mb": None,
    "timeout_s": 300.0, "compression": "none", "allreduce": "flat", "ranks_per_node": None,
    "pipeline_stages": 2, "microbatches": 4, "schedule": "1f1b", "recompute": False,
    "balance": None, "split_points": None, "nproc_per_node": 2, "nnodes": 1, "node_rank": 0,
    "rdzv_endpoint": None, "backend": "auto", "threads": 1, "emulate_network": None,
    "plugins": [], "run_dir": "RUN", "log_every": 10, "tensorboard": False,
    "val_fraction": 0.0, "eval_every": 0, "eval_batches": 4, "sample_tokens": 0,
    "inject_failure": None, "checkpoint_every": 4, "keep_checkpoints": 2, "resume": None,
    "on_checkpoint_error": "stop", "max_restarts": 0,
}  # fmt: skip


def test_config_json_nests_the_parts_and_a_flat_one_still_loads() -> None:
    cfg = TrainConfig.from_dict(FLAT_CONFIG_JSON)
    assert (cfg.optim.lr, cfg.pipeline.microbatches, cfg.checkpoint.checkpoint_every) == (
        0.01,
        4,
        4,
    )
    # every setting kept, none added but those introduced since (at their defaults): the
    # guard's and the periodic sync's
    guard = {"on_nonfinite": "off", "skip_batches": 1, "spike_factor": None}
    guard |= {"spike_window": 20, "inject_nonfinite": None}
    assert cfg.to_flat_dict() == {**FLAT_CONFIG_JSON, **guard, "sync": "every-step"}
    nested = cfg.to_dict()
    assert nested["optim"]["lr"] == 0.01 and nested["pipeline"]["pipeline_stages"] == 2
    assert nested["dp"]["compression"] == "none" and nested["checkpoint"]["keep_checkpoints"] == 2
    assert "lr" not in nested and "pipeline_stages" not in nested
    assert TrainConfig.from_dict(json.loads(json.dumps(nested))) == cfg


def test_a_run_directory_with_a_flat_config_json_resumes(tmp_path) -> None:
    """A run directory written before the parts keeps resuming: its flat settings are the
    run's, ``--steps`` extends it, and a changed setting is still refused by name."""
    from syncline.cli.main import build_parser, config_from_args

    run = tmp_path / "run"
    (run / "checkpoints" / "step-00000004").mkdir(parents=True)
    # an intact (empty) checkpoint: the command line verifies it before launch
    manifest = {"step": 4, "files": {}}
    (run / "checkpoints" / "step-00000004" / "MANIFEST.json").write_text(json.dumps(manifest))
    (run / "config.json").write_text(json.dumps({**FLAT_CONFIG_JSON, "run_dir": str(run)}))
    resumed = config_from_args(
        build_parser().parse_args(["train", "--resume", str(run), "--steps", "12"])
    )
    want = {**FLAT_CONFIG_JSON, "run_dir": str(run), "resume": str(run), "steps": 12}
    assert resumed == TrainConfig.from_flat(**want)
    assert resumed.pipeline.schedule == "1f1b" and resumed.checkpoint.resume == str(run)
    with pytest.raises(ConfigError, match=re.escape("lr=0.5 differs from the run's 0.01")):
        config_from_args(build_parser().parse_args(["train", "--resume", str(run), "--lr", "0.5"]))
