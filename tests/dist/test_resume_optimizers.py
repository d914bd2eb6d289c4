"""LAMB (whose state holds a Python ``int`` step) trains, checkpoints and resumes bit-exact
through ``syncline train`` (issue 39): under data parallelism with the default checkpointing,
and in a 1F1B pipeline. Before the fix its first checkpoint failed with ``optimizer state
0.wte.weight/step is not a tensor``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from syncline.train.checkpoint import load_checkpoint
from tests.dist.test_resume import PIPE, TINY, profiled_balance
from tests.zoo.exact import assert_exact
from tests.zoo.train import train, train_restarted

# the README's large-batch recipe, at the tiny GPT's batch of 8
LAMB = ["--optimizer", "lamb", "--lr", "0.001", "--lr-scaling", "sqrt", "--base-batch-size", "4"]


def _assert_same_run(ref: dict, got: dict, optimizers: str) -> None:
    assert ref["model"].keys() == got["model"].keys()
    for k in ref["model"]:
        assert torch.equal(ref["model"][k], got["model"][k]), k
    assert_exact(ref[optimizers], got[optimizers], optimizers)


def _restarted(run: Path, *flags: str) -> str:
    """Rank 1 dies at step 3; both ranks restart (as torchrun's attempt 1, in-process) and
    resume from step 2."""
    res = train_restarted(
        *flags, "--run-dir", str(run), "--inject-failure", "1:3", "--max-restarts", "1"
    )
    assert "resumed from" in res.stdout and "(step 2)" in res.stdout, res.stdout[-3000:]
    return res.stdout


def test_lamb_with_default_checkpointing_resumes_bit_exact(tmp_path) -> None:
    """The reference run keeps the default ``--checkpoint-every`` (its one checkpoint is
    after the last step); the restarted run checkpoints every 2 steps and ends with the same
    weights and the same LAMB state, its ``step`` still an ``int``."""
    flags = [*TINY, *LAMB, "--steps", "6"]
    train(*flags, "--run-dir", str(tmp_path / "ref"))
    assert [p.name for p in (tmp_path / "ref" / "checkpoints").iterdir()] == ["step-00000006"]
    _restarted(tmp_path / "run", *flags, "--checkpoint-every", "2")
    ref, got = (load_checkpoint(tmp_path / run / "checkpoint.pt") for run in ("ref", "run"))
    _assert_same_run(ref, got, "optimizer")
    assert {type(s["step"]) for s in ref["optimizer"]["state"].values()} == {int}
    assert {s["step"] for s in ref["optimizer"]["state"].values()} == {6}


def test_lamb_in_a_1f1b_pipeline_resumes_bit_exact(tmp_path) -> None:
    """Two stages, each its own LAMB: the gathered final state of the restarted run equals
    the uninterrupted run's (cut as the restarted one was), stage for stage, ``int`` steps
    included."""
    flags = [*PIPE, *LAMB, "--schedule", "1f1b", "--steps", "6"]
    _restarted(tmp_path / "run", *flags)
    train(*flags, "--balance", profiled_balance(tmp_path / "run"), "--run-dir", str(tmp_path / "ref"))
    ref, got = (load_checkpoint(tmp_path / run / "checkpoint.pt") for run in ("ref", "run"))
    _assert_same_run(ref, got, "optimizers")
    steps = {type(s["step"]) for o in ref["optimizers"].values() for s in o["state"].values()}
    assert sorted(ref["optimizers"]) == [0, 1] and steps == {int}
