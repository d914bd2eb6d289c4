"""The planner on the two papers' setups: the shapes their results have must hold.

Search spaces are cut (at most 16 micro-batches) so that the module runs in a few seconds;
the benchmark itself (``python -m benchmarks.planner_papers``) searches up to 64.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest

from benchmarks.planner_papers.main import (
    GPT_RUNS,
    SCHEDULES,
    alexnet_costs,
    gpt_row,
    gradientflow_cluster,
    gradientflow_rows,
    main,
    pipedream_cluster,
)
from syncline.planner import Configuration, predict

GB = 10**9


RUN_39 = next(r for r in GPT_RUNS if r.model == "gpt-3.9b" and r.ranks == 64)


@pytest.fixture(scope="module")
def gpt39() -> dict[str, Any]:
    return gpt_row(RUN_39, pipedream_cluster(), max_microbatches=16)


@pytest.fixture(scope="module")
def alexnet() -> dict[tuple[int, str, str], dict[str, Any]]:
    doc = gradientflow_rows([8, 64, 512])
    return {(r["ranks"], r["allreduce"], r["variant"]): r for r in doc["rows"]}


def test_2bw_beats_flush_beats_gpipe_for_gpt_3_9b_on_64_ranks(gpt39: dict[str, Any]) -> None:
    best = gpt39["best_per_schedule"]
    assert set(best) == set(SCHEDULES)
    rate = {name: best[name]["samples_per_s"] for name in SCHEDULES}
    assert rate["2bw"] > rate["1f1b"] > rate["gpipe"]
    assert gpt39["speedup_2bw_over_1f1b"] > 1.02
    assert gpt39["speedup_2bw_over_gpipe"] > gpt39["speedup_2bw_over_1f1b"]
    # 2BW is never flushed: m micro-batches of its slowest stage. The same pipeline flushed
    # also fills and drains: every other stage's work once ((m+d-1)/m when balanced).
    two = best["2bw"]
    assert two["breakdown_s"]["bubble"] < 0.01 * two["step_s"]
    m, b = two["microbatches"], two["microbatch_size"]
    # (the closed form leaves messages out: give each GPU its own port so that they hide)
    cluster = dataclasses.replace(pipedream_cluster(), inter_ports_per_node=8)
    costs = RUN_39.costs(cluster)
    step = {}
    for name in ("2bw", "1f1b"):
        config = Configuration(64, 512, stages=two["depth"], schedule=name, microbatches=m)
        step[name] = predict(costs, cluster, config)
    per_stage, start = [], 0
    for size in step["1f1b"].config.balance or ():
        layers = costs.layers[start : start + size]
        start += size
        per_stage.append(sum(x.forward.at(b) + x.backward.at(b) for x in layers))
    slowest = max(per_stage)
    assert step["2bw"].step_s == pytest.approx(m * slowest, rel=0.02)
    expected = (m * slowest + sum(per_stage) - slowest) / (m * slowest)
    assert step["1f1b"].step_s / step["2bw"].step_s == pytest.approx(expected, rel=0.02)


def test_gpt_3_9b_needs_a_pipeline_on_16gb(gpt39: dict[str, Any]) -> None:
    dp = gpt39["data_parallel"]
    assert not dp["fits"]
    # fp16 weights and gradients, fp32 Adam moments: 12 bytes a parameter, all on each rank
    assert dp["peak_gib"] * 2**30 > 12 * gpt39["params"] > 16 * GB
    pick = gpt39["pick"]
    assert pick["fits"] and pick["depth"] > 1 and pick["peak_gib"] * 2**30 <= 16 * GB
    # what 2BW pays for its speed: a second fp16 weight version on every rank
    two = gpt39["best_per_schedule"]["2bw"]
    cluster = pipedream_cluster()
    costs = RUN_39.costs(cluster)
    held = {}
    for name in ("2bw", "1f1b"):
        config = Configuration(
            64,
            512,
            stages=two["depth"],
            schedule=name,
            microbatches=two["microbatches"],
            recompute=two["recompute"],
        )
        held[name] = predict(costs, cluster, config)
    pairs = zip(held["2bw"].bytes_per_rank, held["1f1b"].bytes_per_rank, strict=True)
    extra = [a - b for a, b in pairs]
    start, versions = 0, []
    for size in held["2bw"].config.balance or ():
        versions.append(2 * sum(x.params for x in costs.layers[start : start + size]))
        start += size
    assert extra == pytest.approx(versions, abs=2)


def test_alexnet_costs_match_the_assumed_single_gpu_rate() -> None:
    costs = alexnet_costs(3300.0)
    assert costs.params == 61_100_840
    single = predict(costs, gradientflow_cluster(), Configuration(1, 128, optimizer="sgd"))
    assert single.samples_per_s == pytest.approx(3300.0)


def test_gradientflow_figures_derived_from_the_paper() -> None:
    derived = gradientflow_rows([8])["derived_from_paper"]
    assert derived["images_per_s_512"] == pytest.approx(95 * 1_281_167 / 90)
    assert derived["images_per_s_1"] == pytest.approx(3298, abs=1)
    assert derived["efficiency_512"] == pytest.approx(0.80, abs=0.005)


def test_one_server_scales_almost_perfectly(alexnet: dict[tuple[int, str, str], Any]) -> None:
    for (ranks, _algorithm, variant), row in alexnet.items():
        if ranks == 8:
            assert row["efficiency"] > 0.99, variant


def test_lazy_allreduce_then_csc_scale_better_at_512(
    alexnet: dict[tuple[int, str, str], Any],
) -> None:
    for algorithm in ("flat", "hierarchical"):
        eff = {v: alexnet[512, algorithm, v]["efficiency"] for v in ("per-layer", "lazy")}
        eff["lazy+csc"] = alexnet[512, algorithm, "lazy+csc"]["efficiency"]
        assert eff["per-layer"] < eff["lazy"] < eff["lazy+csc"], algorithm
    # per-layer allreduces pay 2(p-1) latencies each: the gap to lazy grows with the ranks
    gap = {
        n: alexnet[n, "flat", "lazy"]["efficiency"] - alexnet[n, "flat", "per-layer"]["efficiency"]
        for n in (64, 512)
    }
    assert gap[512] > gap[64] > 0
    for variant in ("per-layer", "lazy", "lazy+csc"):
        assert (
            alexnet[512, "flat", variant]["efficiency"] < alexnet[64, "flat", variant]["efficiency"]
        )


def test_main_prints_and_writes_the_comparison(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "planner_papers.json"
    assert main(["--max-microbatches=8", "--gf-ranks=8,512", f"--out={out}"]) == 0
    text = capsys.readouterr().out
    assert "2BW/GPipe" in text and "lazy+csc" in text
    doc = json.loads(out.read_text())
    rows = doc["pipedream_2bw"]["rows"]
    assert [(r["model"], r["ranks"]) for r in rows] == [(r.model, r.ranks) for r in GPT_RUNS]
    assert all(math.isfinite(r["pick"]["samples_per_s"]) for r in rows)
    assert {r["ranks"] for r in doc["gradientflow"]["rows"]} == {8, 512}


def test_validation_sets_each_published_number_beside_its_prediction(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "planner_papers.json"
    assert main(["--max-microbatches=8", "--gf-ranks=8,512", f"--out={out}"]) == 0
    assert "published number" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    checks = doc["validation"]
    assert len(checks) == 4 * (len(GPT_RUNS) + 2) + 2  # two rules, two cost models; GF
    for check in checks:
        assert {"quantity", "paper", "predicted", "error", "met"} <= set(check)
    assert doc["assumptions"]["max_microbatches"] == 8
    assert doc["pipedream_2bw"]["cluster"]["device"]["source"]
    rows = doc["pipedream_2bw"]["rows"]
    # at most 8 micro-batches: those of the larger batches (256 on 8 GPUs, 2048 on 64) are
    # too large to fit anywhere; the smaller batches fit
    assert {r["batch_size"] for r in rows if r["pick_2bw"] is None} <= {256, 2048}
    assert all(r["pick_2bw"] for r in rows if r["batch_size"] in (64, 512))
    for row in rows:
        two = row["pick_2bw"]
        if two is None:
            continue
        assert two["fits"]
        at = row["corresponding_at_pick"]
        for summary in at["best"].values():  # corresponding: the same depth and width
            assert (summary["depth"], summary["width"]) == (two["depth"], two["width"])
        assert at["2bw_over_gpipe"] >= 1.0 and at["2bw_over_flush"] >= 1.0
        paper = row["corresponding_at_paper_depth"]
        assert all(s["depth"] == row["paper_depth"] for s in paper["best"].values())
