"""Property-based fuzz of ``syncline train``'s options (issue 12): whatever the user types,
the command line either yields a valid ``TrainConfig`` or stops with exit code 2 and one line
naming the value, before any process starts; never a traceback."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from syncline.cli.main import build_parser, config_from_args
from syncline.errors import ConfigError
from syncline.train.config import TrainConfig

FLAG = object()  # an option that takes no value

_INT = st.one_of(st.integers(-3, 70).map(str), st.sampled_from(["x", "1.5", "", "1e3"]))
_FLOAT = st.one_of(
    st.floats(-1, 100, allow_nan=False).map(repr),
    st.sampled_from(["nan", "inf", "-inf", "fast", "0", "1e-9"]),
)
_SPECS = ["none", "fp16", "bf16", "topk:0.01", "topk:-1", "topk:2", "csc:0.01:warmup=5"]
_SPECS += ["csc:0.5:ramp=exp", "csc:2", "csc:0.01:warmup=-1", "powersgd:2", "powersgd:0"]
_SPECS += ["powersgd:2:warmup=x", "fp16:3", "zzz", "csc:0.01:bogus=1", ":", ""]

OPTIONS: dict[str, st.SearchStrategy[object]] = {
    "--model": st.sampled_from(["gpt", "cnn", "vit", ""]),
    "--data": st.sampled_from(["stdlib", "digits", "synthetic", "imagenet"]),
    "--steps": _INT,
    "--batch-size": _INT,
    "--seq-len": _INT,
    "--lr": _FLOAT,
    "--optimizer": st.sampled_from(["adamw", "sgd", "lamb"]),
    "--momentum": _FLOAT,
    "--weight-decay": _FLOAT,
    "--warmup-steps": _INT,
    "--seed": _INT,
    "--bucket-cap-mb": _FLOAT,
    "--first-bucket-cap-mb": _FLOAT,
    "--timeout": _FLOAT,
    "--compression": st.sampled_from(_SPECS),
    "--allreduce": st.sampled_from(["flat", "hierarchical", "tree"]),
    "--ranks-per-node": _INT,
    "--pipeline-stages": _INT,
    "--microbatches": _INT,
    "--schedule": st.sampled_from(["gpipe", "1f1b", "2bw", "interleaved", "zb"]),
    "--recompute": st.just(FLAG),
    "--balance": st.sampled_from(["2,2", "1,3", "4", "0,4", "a,b", "", "1,1,1,1,1"]),
    "--nproc-per-node": _INT,
    "--nnodes": _INT,
    "--node-rank": _INT,
    "--rdzv-endpoint": st.sampled_from(["10.0.0.1:29500", "host", ":1"]),
    "--backend": st.sampled_from(["auto", "gloo", "nccl", "mpi"]),
    "--threads": _INT,
    "--log-every": _INT,
    "--inject-failure": st.sampled_from(["1:5", "0:0", "5:1", "x", "1:-1", "1:2:3"]),
    "--checkpoint-every": _INT,
    "--keep-checkpoints": _INT,
    "--on-checkpoint-error": st.sampled_from(["stop", "skip", "retry", ""]),
    "--max-restarts": _INT,
    "--resume": st.sampled_from(["/nonexistent/run", ""]),
    "--n-layer": _INT,
    "--n-embd": _INT,
    "--n-head": _INT,
    "--cnn-width": _INT,
    "--model-option": st.sampled_from(["n_layer=2", "bogus=1", "n_embd=x", "noequals"]),
}


@st.composite
def command_lines(draw: st.DrawFn) -> list[str]:
    names = draw(st.lists(st.sampled_from(sorted(OPTIONS)), unique=True, max_size=6))
    argv = ["train"]
    for name in names:
        value = draw(OPTIONS[name])
        argv += [name] if value is FLAG else [name, str(value)]
    return argv


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(command_lines())
def test_any_command_line_is_a_config_or_one_clear_line(argv) -> None:
    cwd = os.getcwd()
    try:
        ns = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse: its usage line and exit code 2
        assert exc.code == 2, argv
        return
    try:
        cfg = config_from_args(ns)
    except ConfigError as exc:
        message = str(exc).strip()
        assert message and "\n" not in message, (argv, message)
        assert "Traceback" not in message
        return
    finally:
        assert os.getcwd() == cwd
    assert isinstance(cfg, TrainConfig)
    # a valid config survives its own round trip through config.json
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg, argv
