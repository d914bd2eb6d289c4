"""`syncline train` end to end: artifacts, bad input, a dying rank.

The launcher's own tests go through torchrun (marked ``slow``: a complete run directory, a
dying rank named by the job, an emulated network); the others run the command's validation
and the workers' code in-process (:mod:`tests.zoo.train`), or ``main`` itself for bad input.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from syncline.train.checkpoint import load_checkpoint
from tests.zoo.cli import syncline
from tests.zoo.ids import flags_id
from tests.zoo.train import cli, train


@pytest.mark.slow  # the launcher end to end: options -> config.json -> torchrun -> workers
def test_train_writes_a_complete_run_directory(tmp_path) -> None:
    run = tmp_path / "run"
    res = syncline(
        "train",
        "--steps",
        "12",
        "--log-every",
        "4",
        "--n-layer",
        "2",
        "--n-embd",
        "64",
        "--batch-size",
        "16",
        "--run-dir",
        str(run),
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "samples/s" in res.stdout and "tokens/s" in res.stdout and "summary:" in res.stdout
    for name in ("config.json", "metrics.jsonl", "loss.png", "checkpoint.pt", "summary.json"):
        assert (run / name).is_file(), name
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["steps"] == 12 and cfg["nproc_per_node"] == 2
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 4, 8, 11]
    assert all(r["wire_bytes"] > 0 for r in records)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_loss"] < summary["first_loss"]
    state = load_checkpoint(run / "checkpoint.pt")
    assert state["step"] == 12 and state["config"] == cfg
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # 30 steps to a 20 % lower loss: a convergence check (the CNN: unit tests)
def test_cnn_on_digits_trains(tmp_path) -> None:
    train(
        "--model",
        "cnn",
        "--steps",
        "30",
        "--log-every",
        "29",
        "--optimizer",
        "sgd",
        "--lr",
        "0.05",
        "--batch-size",
        "64",
        "--run-dir",
        str(tmp_path / "cnn"),
    )
    summary = json.loads((tmp_path / "cnn" / "summary.json").read_text())
    assert summary["data"] == "digits"
    assert summary["final_loss"] < 0.8 * summary["first_loss"]


# (flags, what the one-line error on stderr contains)
BAD_INPUT = [
    (["--batch-size", "33"], "batch_size=33 is not divisible by the number of ranks 2"),
    (["--model", "vit"], "model='vit' is unknown; valid: gpt, cnn"),
    (["--steps", "0"], "steps=0"),
    (["--nproc-per-node", "100000"], "nproc_per_node=100000 is more than this node allows"),
    (["--bucket-cap-mb", "-1"], "bucket_cap_mb=-1.0 is invalid; valid: a finite number > 0"),
    (["--lr", "fast"], "invalid float value: 'fast'"),
    (["--model", "cnn", "--data", "stdlib"], "does not fit model 'cnn'"),
    (["--compression", "zip"], "compression"),
    (["--compression", "csc:2:momentum=0"], "density=2.0"),
    (["--allreduce", "ring"], "allreduce='ring'"),
    (["--ranks-per-node", "3"], "ranks_per_node=3"),
    (["--emulate-network", "5furlongs"], "invalid rate '5furlongs'"),
]


@pytest.mark.parametrize(("args", "match"), BAD_INPUT, ids=[flags_id(a) for a, _ in BAD_INPUT])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, match) -> None:
    res = cli("train", "--run-dir", str(tmp_path / "bad"), *args)
    assert res.returncode == 2
    assert match in res.stderr
    assert "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "bad").exists()  # stopped before any work


@pytest.mark.slow  # the launcher names the rank that failed first
def test_a_dying_rank_stops_the_job_with_its_name(tmp_path) -> None:
    res = syncline(
        "train",
        "--steps",
        "50",
        "--n-layer",
        "1",
        "--n-embd",
        "32",
        "--inject-failure",
        "1:3",
        "--run-dir",
        str(tmp_path / "dies"),
    )
    assert res.returncode == 1
    assert "job failed: rank 1 (exit code 17) failed first" in res.stderr


def _can_emulate() -> bool:
    import shutil

    return os.geteuid() == 0 and bool(shutil.which("ip")) and bool(shutil.which("tc"))


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


@pytest.mark.slow  # the launcher starts one network namespace per rank
@pytest.mark.skipif(not _can_emulate(), reason="needs root and iproute2 (ip, tc)")
def test_emulated_slow_network_with_csc(tmp_path) -> None:
    run = tmp_path / "emu"
    before = _namespaces()
    res = syncline(
        "train",
        "--steps",
        "8",
        "--log-every",
        "7",
        "--n-layer",
        "2",
        "--n-embd",
        "64",
        "--batch-size",
        "16",
        "--emulate-network",
        "200mbit",
        "--compression",
        "csc:0.01:warmup=2:chunk=1024",
        "--optimizer",
        "sgd",
        "--run-dir",
        str(run),
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "emulated network: 2 nodes joined by 200mbit links" in res.stdout
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["nnodes"] == 2 and cfg["nproc_per_node"] == 1
    summary = json.loads((run / "summary.json").read_text())
    assert summary["compression_ratio"] > 10  # 1 % of the chunks, fp16, plus chunk scores
    assert _namespaces() <= before  # every namespace and link it made is gone


def test_hierarchical_allreduce_on_4_ranks_as_2_nodes(tmp_path) -> None:
    run = tmp_path / "hier"
    train(
        "--steps",
        "6",
        "--log-every",
        "5",
        "--n-layer",
        "1",
        "--n-embd",
        "32",
        "--nproc-per-node",
        "4",
        "--batch-size",
        "16",
        "--allreduce",
        "hierarchical",
        "--ranks-per-node",
        "2",
        "--run-dir",
        str(run),
    )
    summary = json.loads((run / "summary.json").read_text())
    assert summary["allreduce"] == "hierarchical" and summary["world_size"] == 4
    assert summary["final_loss"] < summary["first_loss"]
