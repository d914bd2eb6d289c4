"""`syncline train --pipeline-stages` end to end: artifacts and bad input.

The command's validation and the workers' code run in-process (:mod:`tests.zoo.train`; the
launcher is tested in ``test_cli.py``), bad input and ``--help`` through ``main`` itself.

Each run checks what only a working pipeline produces: a falling loss, a checkpoint that
loads into the unsplit model with weights moved away from the initialisation, and a trace
with the actions of both stages.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from syncline.train.checkpoint import load_checkpoint
from syncline.train.common import build_model_for
from syncline.train.config import TrainConfig
from syncline.train.snapshots import SnapshotStore
from syncline.train.state import read_meta
from tests.zoo.ids import flags_id
from tests.zoo.train import cli, train

TINY = ["--n-layer", "2", "--n-embd", "32", "--seq-len", "16", "--batch-size", "16"]
TINY += ["--warmup-steps", "2", "--log-every", "3"]


def _train(run: Path, *args: str) -> dict[str, Any]:
    res = train("--pipeline-stages", "2", *TINY, "--run-dir", str(run), *args)
    assert "summary:" in res.stdout and "tokens/s" in res.stdout
    summary: dict[str, Any] = json.loads((run / "summary.json").read_text())
    assert summary["final_loss"] < summary["first_loss"]
    return summary


def _check_checkpoint(run: Path) -> None:
    """Loads (strictly) into the unsplit model; every tensor differs from the init."""
    state = load_checkpoint(run / "checkpoint.pt")
    cfg = TrainConfig.from_dict(json.loads((run / "config.json").read_text()))
    assert state["config"] == cfg.to_dict() and state["step"] == cfg.steps
    model = build_model_for(cfg)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(state["model"])
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, init[k])]
    assert len(changed) == len(init), sorted(set(init) - set(changed))
    assert sorted(state["optimizers"]) == [0, 1]


def _trace_kinds(run: Path) -> dict[int, set[str]]:
    """The action kinds trace.json holds per rank (it must be valid JSON)."""
    trace = json.loads((run / "trace.json").read_text())
    kinds: dict[int, set[str]] = {}
    for event in trace["traceEvents"]:
        if event["ph"] == "X":
            assert event["dur"] >= 0
            kinds.setdefault(event["tid"], set()).add(event["cat"])
    return kinds


def test_2bw_pipeline_trains_and_writes_trace_schedule_and_checkpoint(tmp_path) -> None:
    run = tmp_path / "2bw"
    summary = _train(run, "--schedule", "2bw", "--microbatches", "4", "--steps", "8")
    assert summary["schedule"] == "2bw" and summary["microbatches"] == 4
    assert sum(summary["balance"]) == 4  # embedding + 2 blocks + head, profiled
    assert [m["weight_versions"] for m in summary["memory"].values()] == [2, 2]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 3, 6, 7]
    kinds = _trace_kinds(run)
    assert sorted(kinds) == [0, 1]
    assert {"FORWARD", "BACKWARD", "SEND_F", "RECV_B", "STEP"} <= kinds[0]
    assert {"FORWARD", "BACKWARD", "RECV_F", "SEND_B", "STEP"} <= kinds[1]
    png = (run / "schedule.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    _check_checkpoint(run)


def test_1f1b_with_recompute_and_a_given_balance(tmp_path) -> None:
    run = tmp_path / "1f1b"
    summary = _train(run, "--recompute", "--balance", "1,3", "--steps", "7")
    assert summary["schedule"] == "1f1b" and summary["microbatches"] == 4  # 2 x stages
    assert summary["recompute"] is True and summary["balance"] == [1, 3]
    kinds = _trace_kinds(run)
    assert all("RECOMPUTE" in kinds[rank] for rank in (0, 1))
    _check_checkpoint(run)


def test_two_replicas_of_a_2bw_pipeline_with_fp16_gradient_compression(tmp_path) -> None:
    """4 ranks = 2 stages x 2 replicas: each stage's replicas average (fp16 on the wire)."""
    run = tmp_path / "replicas"
    summary = _train(
        run,
        *("--nproc-per-node", "4", "--schedule", "2bw", "--microbatches", "2"),
        *("--compression", "fp16", "--balance", "2,2", "--steps", "6"),
    )
    assert summary["replicas"] == 2 and summary["world_size"] == 4
    # bytes on the wire, summed over the ranks: per step and replica, m=2 activations of
    # 4 sequences x 16 tokens x 32 wide in fp32 go forward and as many gradients back;
    # each stage's replicas send its gradient in fp16. The records hold the rate since the
    # interval in ``wire_steps`` (one record behind: logging sets no barrier, which 2BW's
    # overlap would pay for); the intervals cover every step, and all 6 batches are sent by
    # the last one.
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    sent = {k: 0 for k in ("activations", "gradients", "reduce")}
    covered = []
    assert records[0]["wire_steps"] is None  # nothing collected yet at the first record
    for r in records[1:]:
        a, b = r["wire_steps"]
        assert b <= r["step"] and r["wire_bytes"] == sum(r["wire_split"].values())
        covered += list(range(a + 1, b + 1))
        for k in sent:
            sent[k] += r["wire_split"][k] * (b - a)
    assert covered == list(range(6))
    one_way = 6 * 2 * 2 * (4 * 16 * 32 * 4)  # batches x replicas x micro-batches x bytes
    # the REDUCE: 6 batches x 2 replicas x 2 bytes per parameter
    want = {"activations": one_way, "gradients": one_way, "reduce": 24 * summary["parameters"]}
    for k, v in want.items():  # each record's rate is rounded to a byte
        assert abs(sent[k] - v) <= 3 * len(records), (k, sent[k], v)
    kinds = _trace_kinds(run)
    assert sorted(kinds) == [0, 1, 2, 3]
    assert all("REDUCE" in kinds[rank] for rank in range(4))
    _check_checkpoint(run)


def test_bf16_pipeline_trains(tmp_path) -> None:
    run = tmp_path / "bf16"
    summary = _train(run, "--precision", "bf16", "--steps", "6")
    assert summary["precision"] == "bf16" and "loss_scale" not in summary
    _check_checkpoint(run)


def test_fp16_2bw_pipeline_checkpoints_its_loss_scale_and_resumes(tmp_path) -> None:
    """fp16 under 2BW: the scale goes into the checkpoint's metadata, and a resumed run
    continues from it (no overflow on this tiny model: the scale stays at its start)."""
    run = tmp_path / "fp16"
    args = ("--precision", "fp16", "--schedule", "2bw", "--checkpoint-every", "3")
    summary = _train(run, *args, "--steps", "6")
    assert summary["precision"] == "fp16" and summary["skipped_steps"] == 0
    assert summary["loss_scale"] == 2.0**16
    store = SnapshotStore(run / "checkpoints", keep=2, timeout_s=30)
    snap = store.latest()
    assert snap is not None
    assert read_meta(store, snap)["loss_scale"]["scale"] == 2.0**16
    res = train(
        "--pipeline-stages", "2", *TINY, "--run-dir", str(run), *args,
        "--steps", "8", "--resume", str(run),
    )  # fmt: skip
    # the run's last checkpoint is of its last step (6), so the extension starts there
    assert "resumed from" in res.stdout and "(step 6)" in res.stdout
    resumed = json.loads((run / "summary.json").read_text())
    assert resumed["loss_scale"] == 2.0**16 and resumed["steps"] == 8


# (flags, what the one-line error on stderr contains)
BAD_INPUT = [
    (["--pipeline-stages", "7"], "pipeline_stages=7 needs 7 stages but the gpt model has 6"),
    (
        ["--pipeline-stages", "2", "--schedule", "2bw", "--microbatches", "1"],
        "microbatches=1 must be >= pipeline_stages=2 for 2bw",
    ),
    (["--pipeline-stages", "2", "--balance", "2,x"], "balance='2,x' is not a comma"),
    (
        ["--pipeline-stages", "2", "--compression", "fp16"],
        "compression='fp16' compresses the gradient allreduce of data-parallel replicas",
    ),
]


@pytest.mark.parametrize(("args", "match"), BAD_INPUT, ids=[flags_id(a) for a, _ in BAD_INPUT])
def test_bad_pipeline_input_is_one_line_and_exit_2(tmp_path, args, match) -> None:
    """A few through the real command; the rest of the checks are tabled in test_config."""
    res = cli("train", "--run-dir", str(tmp_path / "bad"), *args)
    assert res.returncode == 2, res.stderr
    assert match in res.stderr
    assert "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "bad").exists()


def test_help_documents_the_pipeline_options() -> None:
    res = cli("train", "--help")
    assert res.returncode == 0
    for option in ("--pipeline-stages", "--microbatches", "--schedule", "--recompute", "--balance"):
        assert option in res.stdout
    assert "trace.json" in res.stdout and "schedule.png" in res.stdout
