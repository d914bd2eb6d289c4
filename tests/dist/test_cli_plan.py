"""`syncline plan` end to end: profile this machine on real gloo ranks, rank, run the pick.

The profile is measured once per module and reused: the tests check
what only a working profiler and planner produce (a cluster whose links and base memory
were measured, a model whose per-layer costs are positive), that every candidate's
``train_args`` is accepted by ``syncline train`` and that ``--plan auto`` trains the top
candidate and records the prediction next to the measurement.

The commands run through ``main`` in this process, with torchrun's part played in-process
(:func:`tests.zoo.train.launched`): the profile's ranks and ``--plan auto``'s training are the
workers' own ``main`` on ranks forked with torchrun's environment (the launcher is tested
elsewhere), about a second each. Bad input goes through ``main`` alone.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from tests.zoo.train import cli, launched

TINY = ["--n-layer", "2", "--n-embd", "32", "--seq-len", "16", "--batch-size", "16"]


@pytest.fixture(scope="module")
def profiled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("plan") / "profile.json"
    res = launched("plan", *TINY, "--profile", f"--profile-out={out}", "--json", "--top=1000")
    assert res.returncode == 0, res.stderr[-3000:]
    doc: dict[str, Any] = json.loads(res.stdout)
    return out, doc


def test_profile_measures_this_machine(profiled: tuple[Path, dict[str, Any]]) -> None:
    path, _ = profiled
    doc = json.loads(path.read_text())
    cluster, model = doc["cluster"], doc["model"]
    assert cluster["ranks_per_node"] == 2
    # (the least-squares latency is clipped at 0 when noise makes the intercept negative)
    assert cluster["intra"]["bandwidth"] > 1e6 and 0 <= cluster["intra"]["latency_s"] < 0.1
    assert 50 * 2**20 < cluster["base_memory"] < cluster["memory_per_rank"]
    assert set(cluster["compress_s_per_byte"]) >= {"none", "fp16", "csc", "topk"}
    # embedding, two blocks, head: each with a positive forward and backward cost (fitted
    # as fixed + per-sample over two micro-batch sizes; either part may be 0 on its own).
    assert len(model["layers"]) == 4
    for layer in model["layers"]:
        for kind in ("forward", "backward"):
            cost = layer[kind]
            assert min(cost.values()) >= 0 and cost["fixed"] + 8 * cost["per_sample"] > 0
    assert model["param_bytes"] == 4  # fp32 weights
    assert sum(layer["params"] for layer in model["layers"]) == 42368  # the model's numel


def test_candidates_are_ranked_and_runnable(profiled: tuple[Path, dict[str, Any]]) -> None:
    _, doc = profiled
    cands = doc["candidates"]
    kinds = {c["schedule"] or "dp" for c in cands}
    assert kinds >= {"dp", "gpipe", "1f1b", "2bw"}
    assert all(c["fits"] for c in cands)
    # best first: by time with lossy compressors charged 5 %, up to 0.5 % ties
    lossy = ("csc", "topk", "powersgd")
    charged = [
        c["predicted_step_s"] * (1.05 if c["compression"].startswith(lossy) else 1.0) for c in cands
    ]
    assert all(a <= b * 1.005**2 for a, b in itertools.pairwise(charged))
    for c in cands:
        assert c["predicted_samples_per_s"] == pytest.approx(16 / c["predicted_step_s"])
        assert c["predicted_peak_bytes"] > 0
        assert "--batch-size=16" in c["train_args"]


def test_plan_auto_trains_the_top_candidate(
    profiled: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    path, doc = profiled
    run = tmp_path / "run"
    args = ["train", "--plan", "auto", f"--plan-cluster={path}", *TINY]
    res = launched(*args, "--steps=4", "--warmup-steps=2", f"--run-dir={run}")
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    plan = summary["plan"]
    best = doc["candidates"][0]
    assert plan["chosen"] == best["label"] and plan["train_args"] == best["train_args"]
    assert plan["predicted_step_s"] == pytest.approx(best["predicted_step_s"], rel=0.05)
    assert plan["measured_step_s"] > 0 and plan["measured_peak_bytes"] > 50 * 2**20
    assert summary["final_loss"] < summary["first_loss"]


def test_plan_refuses_bad_input() -> None:
    res = cli("plan", *TINY, "--ranks=0", "--cluster=/nonexistent.json")
    assert res.returncode != 0 and "--ranks" in res.stderr
    res = cli("plan", *TINY)
    assert res.returncode != 0 and "--profile" in res.stderr
    res = cli("plan", *TINY, "--cluster=/nonexistent.json")
    assert res.returncode != 0 and "nonexistent" in res.stderr
