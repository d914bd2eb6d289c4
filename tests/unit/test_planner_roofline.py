"""Costs computed on a device's roofline, mixed precision's memory, the head as a bottleneck,
and the search's tie rule: each against a closed form."""

from __future__ import annotations

import json

import pytest

from syncline.errors import ConfigError
from syncline.planner import (
    Affine,
    Cluster,
    Configuration,
    Device,
    LayerCost,
    Link,
    ModelCosts,
    SearchSpace,
    predict,
    search,
    transformer_costs,
)
from syncline.planner.costs import ADAM_MIXED_BYTES_PER_PARAM, BLOCK_KERNELS

GiB = 2**30
DEVICE = Device("toy", 100e12, "1000GB", 0.5, 5e-6, "made up for the test")


def _cluster(memory: int = 64 * GiB, **kw) -> Cluster:
    link = Link(1e30, 0.0)
    return Cluster("test", 8, memory, link, link, device=DEVICE, **kw)


def test_the_efficiency_curve_rises_with_the_work_of_a_kernel() -> None:
    assert DEVICE.memory_bandwidth == 1e12
    assert DEVICE.sustained_flops == 50e12
    assert DEVICE.seconds(50e9) == pytest.approx(5e-6 + 1e-3)
    assert DEVICE.seconds(0.0, 1e9) == pytest.approx(5e-6 + 1e-3)  # memory-bound
    curve = [DEVICE.efficiency_at(w) for w in (1e6, 1e8, 1e10, 1e12)]
    assert curve == sorted(curve) and curve[-1] < 0.5
    # eff(W) = e / (1 + e * peak * kernel_s / W)
    assert DEVICE.efficiency_at(1e9) == pytest.approx(0.5 / (1 + 0.5 * 100e12 * 5e-6 / 1e9))


def test_a_device_needs_its_sources_and_sane_numbers() -> None:
    with pytest.raises(ConfigError, match="source"):
        Device("x", 1e12, 1e9, 0.5, 0.0, " ")
    with pytest.raises(ConfigError, match=r"device\.efficiency=1\.5"):
        Device("x", 1e12, 1e9, 1.5, 0.0, "s")
    with pytest.raises(ConfigError, match="unknown keys \\['colour'\\]"):
        Device.from_dict({**DEVICE.to_dict(), "colour": "red"})


def test_cluster_with_a_device_and_workspace_round_trips_through_json(tmp_path) -> None:
    c = _cluster(workspace="64MiB", base_memory="1GiB")
    assert c.workspace == 64 * 2**20
    path = tmp_path / "c.json"
    path.write_text(json.dumps(c.to_dict()))
    assert Cluster.load(path) == c


def test_block_costs_are_kernels_fixed_plus_flops_per_sample() -> None:
    s, h, a, v = 128, 256, 4, 1000
    costs = transformer_costs(n_layer=2, n_embd=h, n_head=a, seq_len=s, vocab_size=v, device=DEVICE)
    block = costs.layers[1]
    flops = 24 * s * h * h + 4 * s * s * h
    assert block.forward == Affine(BLOCK_KERNELS[0] * 5e-6, flops / 50e12)
    assert block.backward == Affine(BLOCK_KERNELS[1] * 5e-6, 2 * flops / 50e12)
    # a larger micro-batch amortises the fixed part: time per sample falls with b
    per_sample = [block.forward.at(b) / b for b in (1, 2, 8)]
    assert per_sample == sorted(per_sample, reverse=True)
    # the embedding's backward writes the token table's dense gradient every micro-batch
    assert costs.layers[0].backward.fixed == pytest.approx(4 * 5e-6 + v * h * 2 / 1e12)
    # the loss over fp32 logits is memory-bound: 10 s V bytes forward, 12 s V backward
    assert costs.loss.per_sample == pytest.approx(22 * s * v / 1e12)
    assert costs.update_s_per_param == pytest.approx(ADAM_MIXED_BYTES_PER_PARAM / 1e12)
    assert costs.master_bytes == 4 and costs.param_bytes == 2
    with pytest.raises(ConfigError, match="flops_per_s or a device"):
        transformer_costs(n_layer=1, n_embd=8, n_head=1, seq_len=4, vocab_size=10)


def _uniform(layers: int, head: float = 1.0, master: int = 0) -> ModelCosts:
    def layer(name: str, f: float) -> LayerCost:
        return LayerCost(name, Affine(0, f), Affine(0, 2 * f), 1000, 100.0, 10.0)

    body = [layer(f"l{i}", 1.0) for i in range(layers - 1)]
    return ModelCosts(
        "u", (*body, layer("head", head)), input_bytes=10.0, param_bytes=2, master_bytes=master
    )


def test_mixed_precision_counts_fp32_master_weights_once_whatever_the_versions() -> None:
    d, m = 2, 4
    plain, mixed = _uniform(d), _uniform(d, master=4)
    for schedule, versions in (("1f1b", 1), ("2bw", 2)):
        config = Configuration(d, m, stages=d, schedule=schedule, microbatches=m)
        a = predict(plain, _cluster(), config).bytes_per_rank
        b = predict(mixed, _cluster(), config).bytes_per_rank
        assert [y - x for x, y in zip(a, b, strict=True)] == [4000, 4000], schedule
        # 16-bit weights times versions, a 16-bit gradient, the master, Adam's two moments
        held = (2, 1)
        stash = [h * 110.0 for h in held]
        state = 1000 * (2 * versions + 2 + 4 + 8)
        assert list(b) == [int(state + x) for x in stash], schedule


def test_workspace_and_base_memory_of_the_cluster_are_on_every_rank() -> None:
    costs = _uniform(2)
    config = Configuration(2, 4, stages=2, schedule="1f1b", microbatches=4)
    bare = predict(costs, _cluster(), config).bytes_per_rank
    held = predict(costs, _cluster(workspace=1000, base_memory=500), config).bytes_per_rank
    assert [y - x for x, y in zip(bare, held, strict=True)] == [1500, 1500]


def test_a_head_that_makes_its_stage_the_slowest_is_named_the_bottleneck() -> None:
    config = Configuration(2, 4, stages=2, schedule="2bw", microbatches=4)
    heavy = predict(_uniform(2, head=3.0), _cluster(), config)
    assert heavy.bottleneck == "head"
    assert heavy.step_s == pytest.approx(4 * 9.0)  # m x the head stage's F + B
    light = predict(_uniform(2, head=1.0), _cluster(), config)
    assert light.bottleneck == "compute"


def test_without_a_tie_throughput_alone_decides() -> None:
    costs = _uniform(4)
    space = SearchSpace(ranks=2, batch_size=8, compressions=("none",), tie=0.0)
    found = search(space, costs, _cluster())
    times = [p.step_s for p in found if p.fits]
    assert times == sorted(times)
    with pytest.raises(ConfigError, match=r"tie=1\.0"):
        SearchSpace(ranks=2, batch_size=8, tie=1.0)
    unbounded = SearchSpace(ranks=2, batch_size=256, max_microbatches=None, data_parallel=False)
    ms = {p.config.microbatches for p in search(unbounded, costs, _cluster())}
    assert max(ms) == 256


def test_plan_with_a_device_cluster_prices_the_gpt_on_its_roofline(tmp_path) -> None:
    from syncline.cli.main import build_parser, config_from_args
    from syncline.cli.plan import plan

    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(_cluster(workspace="64MiB").to_dict()))
    model = ["--n-layer=2", "--n-embd=64", "--n-head=4", "--seq-len=32", "--batch-size=8"]
    ns = build_parser().parse_args(["plan", *model, f"--cluster={path}", "--ranks=2", "--top=3"])
    document, text = plan(config_from_args(ns, planning=True), ns)
    assert "toy" not in text and "2 ranks of test" in text
    assert document["cluster"]["device"]["kind"] == "toy"
    best = document["candidates"][0]
    assert best["predicted_peak_bytes"] >= 64 * 2**20  # the cluster's workspace
    # every layer pays its kernels' fixed cost: a step is at least the blocks' kernels
    assert best["predicted_step_s"] >= 2 * sum(BLOCK_KERNELS) * 5e-6
