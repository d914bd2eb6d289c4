"""The planner's cost model against closed forms, and its search against the real CLI."""

from __future__ import annotations

import itertools
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from syncline.errors import ConfigError
from syncline.planner import (
    Affine,
    Cluster,
    Configuration,
    LayerCost,
    Link,
    ModelCosts,
    SearchSpace,
    parse_bandwidth,
    parse_size,
    predict,
    search,
    to_json,
    transformer_costs,
)
from syncline.planner.collectives import allreduce_s, bucket_phases, ring_allreduce_s

GiB = 2**30


def _uniform(layers: int, f: float = 1.0, b: float = 2.0, params: int = 1000) -> ModelCosts:
    """Layers of per-sample cost ``f`` forward and ``b`` backward (no fixed part)."""
    return ModelCosts(
        "uniform",
        tuple(
            LayerCost(f"l{i}", Affine(0, f), Affine(0, b), params, 100.0, 10.0)
            for i in range(layers)
        ),
        input_bytes=10.0,
    )


def _cluster(bandwidth: float = 1e30, latency: float = 0.0, rpn: int = 8, **kw) -> Cluster:
    link = Link(bandwidth, latency)
    return Cluster("test", rpn, 64 * GiB, link, link, **kw)


def test_sizes_and_rates_parse_with_units_and_bad_values_are_named() -> None:
    assert parse_size("16GiB") == 16 * GiB
    assert parse_size("512MB") == 512 * 10**6
    assert parse_bandwidth("8gbit") == 1e9
    with pytest.raises(ConfigError, match="memory_per_rank='16 parsecs'"):
        parse_size("16 parsecs", "memory_per_rank")
    with pytest.raises(ConfigError, match="bandwidth='fast'"):
        parse_bandwidth("fast")
    with pytest.raises(ConfigError, match="ranks_per_node=0"):
        Cluster("x", 0, "1GiB", Link(1.0), Link(1.0))
    with pytest.raises(ConfigError, match="unknown keys \\['colour'\\]"):
        Cluster.from_dict(
            {
                "name": "x",
                "ranks_per_node": 1,
                "memory_per_rank": 1,
                "intra": {"bandwidth": 1},
                "inter": {"bandwidth": 1},
                "colour": "red",
            }
        )


def test_cluster_round_trips_through_json(tmp_path) -> None:
    c = _cluster(1e9, 1e-5, compress_s_per_byte={"csc": 1e-9}, base_memory=3 * 2**20)
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"cluster": c.to_dict()}))
    assert Cluster.load(path) == c


def test_ring_and_hierarchical_allreduce_follow_the_alpha_beta_model() -> None:
    link = Link(1e9, 1e-5)
    # 2(p-1) latencies + 2(p-1)/p * n / bw, plus summing (p-1)/p * n bytes
    assert ring_allreduce_s(1e8, 4, link, 1e-10) == pytest.approx(
        6e-5 + 1.5 * 1e8 / 1e9 + 0.75 * 1e8 * 1e-10
    )
    slow = Cluster("two nodes", 4, GiB, Link(1e10, 1e-6), Link(1e8, 1e-5))
    ranks = list(range(8))
    flat = allreduce_s(1e8, ranks, slow, "flat")
    hier = allreduce_s(1e8, ranks, slow, "hierarchical")
    assert flat == pytest.approx(ring_allreduce_s(1e8, 8, slow.inter))
    # four rings across the nodes, each a quarter of the bytes, sharing the node's one port
    shared = Link(1e8 / 4, 1e-5)
    assert hier == pytest.approx(
        ring_allreduce_s(1e8, 4, slow.intra) + ring_allreduce_s(2.5e7, 2, shared)
    )
    assert flat / 2 < hier < flat
    # with a port per rank, each ring has the whole link
    ported = Cluster("two nodes", 4, GiB, slow.intra, slow.inter, inter_ports_per_node=4)
    assert allreduce_s(1e8, ranks, ported, "hierarchical") == pytest.approx(
        ring_allreduce_s(1e8, 4, slow.intra) + ring_allreduce_s(2.5e7, 2, slow.inter)
    )
    assert allreduce_s(1e8, ranks, ported, "hierarchical") < flat / 2


def test_bucket_traffic_is_each_compressors_documented_formula() -> None:
    n = 1_000_000
    assert [p.nbytes for p in bucket_phases("none", n)] == [4 * n]
    assert [p.nbytes for p in bucket_phases("fp16", n)] == [2 * n]
    chunks = math.ceil(n / 32768)
    # scores and the bound, then density x the chunks on average (the fraction carried on)
    phases = [p.nbytes for p in bucket_phases("csc:0.01:chunk=32768", n)]
    assert phases == [4 * (chunks + 1), pytest.approx(2 * 0.01 * chunks * 32768)]
    topk = bucket_phases("topk:0.01", n)
    assert [(p.kind, p.nbytes) for p in topk] == [("allgather", 4e4), ("allgather", 4e4)]
    low = bucket_phases("powersgd:4", n, matrices=[(1000, 1000)])
    assert sum(p.nbytes for p in low) == 4 * 4 * 2000
    with pytest.raises(ConfigError, match="unknown compressor 'zip'"):
        bucket_phases("zip", n)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("d", "m"), [(2, 4), (4, 8), (4, 4)])
def test_flush_schedules_take_m_plus_d_minus_1_slots(schedule: str, d: int, m: int) -> None:
    costs = _uniform(d)  # one layer per stage, F = 1, B = 2 per sample, micro-batches of 1
    config = Configuration(d, m, stages=d, schedule=schedule, microbatches=m)
    p = predict(costs, _cluster(), config)
    assert p.step_s == pytest.approx((m + d - 1) * 3.0)
    assert p.breakdown["bubble"] == pytest.approx((d - 1) * 3.0)


@pytest.mark.parametrize(("d", "m"), [(2, 4), (4, 8), (4, 4)])
def test_2bw_runs_at_m_slots_per_batch_in_its_steady_state(d: int, m: int) -> None:
    costs = _uniform(d)
    p = predict(costs, _cluster(), Configuration(d, m, stages=d, schedule="2bw", microbatches=m))
    assert p.step_s == pytest.approx(m * 3.0)
    assert p.breakdown["bubble"] == pytest.approx(0.0, abs=1e-9)


def test_pipeline_memory_counts_micro_batches_in_flight_and_weight_versions() -> None:
    d, m = 4, 8
    costs = _uniform(d, params=1000)
    state = 1000 * (4 + 4 + 8)  # weights, gradients, AdamW's two moments (fp32)
    stash = 100.0 + 10.0  # activations + the stage's input, per micro-batch of 1 sample
    for schedule, held in (("gpipe", [m] * d), ("1f1b", [4, 3, 2, 1])):
        config = Configuration(d, m, stages=d, schedule=schedule, microbatches=m)
        p = predict(costs, _cluster(), config)
        assert list(p.bytes_per_rank) == [int(state + h * stash) for h in held], schedule
    p = predict(costs, _cluster(), Configuration(d, m, stages=d, schedule="2bw", microbatches=m))
    assert list(p.bytes_per_rank) == [int(state + 4000 + h * stash) for h in (4, 3, 2, 1)]
    # recomputation keeps only the inputs in flight, plus one micro-batch's activations
    p = predict(
        costs,
        _cluster(),
        Configuration(d, m, stages=d, schedule="1f1b", microbatches=m, recompute=True),
    )
    assert list(p.bytes_per_rank) == [int(state + h * 10.0 + 100.0) for h in (4, 3, 2, 1)]


def test_data_parallel_hides_the_allreduce_behind_backward_until_it_no_longer_fits() -> None:
    costs = _uniform(4, params=2**20)  # 4 MiB of gradients per layer, buckets of 4 MiB
    config = Configuration(2, 2, bucket_cap_mb=4, first_bucket_cap_mb=4)
    compute = (1.0 + 2.0) * 4  # 4 layers, 1 sample each
    fast = predict(costs, _cluster(bandwidth=1e12), config)
    assert fast.step_s == pytest.approx(compute, rel=1e-3)
    # each bucket takes 2(p-1)/p * 4 MiB / bw = 1.5 s: the last one starts when backward
    # ends (its layer is the first), so 1.5 s stay exposed, the rest overlaps
    bw = 4 * 2**20 / 1.5
    slow = predict(costs, _cluster(bandwidth=bw), config)
    assert slow.breakdown["allreduce"] == pytest.approx(1.5)
    assert slow.step_s == pytest.approx(compute + 1.5)


def test_fixed_costs_make_small_micro_batches_pay_per_micro_batch() -> None:
    layer = LayerCost("l", Affine(0.5, 1.0), Affine(0.5, 2.0), 10, 1.0, 1.0)
    costs = ModelCosts("m", (layer, layer), input_bytes=1.0)
    few = predict(costs, _cluster(), Configuration(2, 16, stages=2, schedule="2bw", microbatches=2))
    many = predict(
        costs, _cluster(), Configuration(2, 16, stages=2, schedule="2bw", microbatches=16)
    )
    assert few.step_s == pytest.approx(2 * (1.0 + 8 * 3.0))
    assert many.step_s == pytest.approx(16 * (1.0 + 3.0))


def test_transformer_costs_count_the_parameters_of_syncline_gpt() -> None:
    torch = pytest.importorskip("torch")
    from syncline.models import build_model

    with torch.device("meta"):
        model = build_model("gpt", n_layer=3, n_embd=64, n_head=4, block_size=32)
    costs = transformer_costs(
        n_layer=3, n_embd=64, n_head=4, seq_len=32, vocab_size=256, flops_per_s=1e12
    )
    assert [layer.params for layer in costs.layers] == [
        sum(p.numel() for p in layer.parameters()) for layer in model
    ]


def test_search_ranks_fitting_configurations_first_and_their_train_args_parse() -> None:
    from syncline.cli.main import build_parser, config_from_args

    costs = _uniform(6, params=100_000)
    cluster = Cluster("small", 2, 12_000_000, Link(1e9, 1e-5), Link(1e9, 1e-5))
    found = search(SearchSpace(ranks=4, batch_size=16), costs, cluster)
    fits = [p.fits for p in found]
    assert fits == sorted(fits, reverse=True) and any(fits) and not all(fits)
    fitting = [p for p in found if p.fits]
    lossy = [p.config.compression not in ("none", "fp16", "bf16") for p in fitting]
    cost = [p.step_s * (1.05 if x else 1.0) for p, x in zip(fitting, lossy, strict=True)]
    for a, b in itertools.pairwise(cost):  # by time, up to a 0.5 % tie
        assert a <= b * 1.005**2
    for i, p in enumerate(fitting):  # lossy compression first only when 5 % faster
        later_exact = [q.step_s for q, x in zip(fitting[i:], lossy[i:], strict=True) if not x]
        assert not lossy[i] or all(p.step_s * 1.05 <= t * 1.005**2 for t in later_exact)
    doc = to_json(found, cluster, ["--model=gpt", "--n-layer=4"])
    labels = {row["label"] for row in doc["candidates"]}
    assert {"dp none", "pp 2x2 2bw m=4", "pp 4x1 1f1b m=4 recompute"} <= labels
    for row in doc["candidates"]:
        argv = ["train", *row["model_args"], *row["train_args"]]
        if any(a.startswith("--nnodes") for a in argv):  # each node adds where to meet
            argv.append("--rdzv-endpoint=node0:29500")
        cfg = config_from_args(build_parser().parse_args(argv))
        assert cfg.world_size == 4 and cfg.batch_size == 16
        p = cfg.pipeline
        assert p.pipeline_stages == row["stages"]
        if row["stages"] > 1:
            assert p.schedule == row["schedule"] and p.microbatches == row["microbatches"]
            assert list(p.balance) == row["balance"]
        assert cfg.dp.compression == row["compression"]


def test_configurations_that_cannot_run_are_refused_with_their_values() -> None:
    with pytest.raises(ConfigError, match="stages=3 must divide ranks=4"):
        Configuration(4, 16, stages=3, schedule="1f1b", microbatches=4)
    with pytest.raises(ConfigError, match="batch_size=10 does not split"):
        Configuration(4, 10, stages=2, schedule="1f1b", microbatches=4)
    with pytest.raises(ConfigError, match="batch_size=7"):
        search(SearchSpace(ranks=4, batch_size=7, pipelines=False), _uniform(2), _cluster())


_PROPERTY_MODELS = st.builds(
    lambda n, f, params: ModelCosts(
        "random",
        tuple(
            LayerCost(f"l{i}", Affine(1e-4, f), Affine(2e-4, 2 * f), params, 4e5, 4e4)
            for i in range(n)
        ),
        input_bytes=1e3,
        update_s_per_param=1e-9,
    ),
    st.integers(4, 8),
    st.floats(1e-4, 1e-2),
    st.integers(10_000, 2_000_000),
)


@settings(max_examples=25, deadline=None)
@given(
    costs=_PROPERTY_MODELS,
    bandwidth=st.floats(1e7, 1e11),
    factor=st.floats(1.0, 100.0),
    latency=st.floats(0.0, 1e-3),
    rpn=st.sampled_from([1, 2, 4]),
)
def test_more_bandwidth_never_predicts_slower(
    costs: ModelCosts, bandwidth: float, factor: float, latency: float, rpn: int
) -> None:
    def cluster(bw: float) -> Cluster:
        return Cluster("c", rpn, 64 * GiB, Link(10 * bw, latency), Link(bw, latency))

    space = SearchSpace(ranks=4, batch_size=16, max_microbatches=8)
    slow = {p.config: p.step_s for p in search(space, costs, cluster(bandwidth))}
    fast = {p.config: p.step_s for p in search(space, costs, cluster(bandwidth * factor))}
    assert slow.keys() == fast.keys()
    for config, t in fast.items():
        assert t <= slow[config] * (1 + 1e-9), config.describe()


@settings(max_examples=25, deadline=None)
@given(costs=_PROPERTY_MODELS, memory=st.integers(2**24, 2**31), factor=st.floats(1.0, 8.0))
def test_more_memory_never_removes_a_candidate(
    costs: ModelCosts, memory: int, factor: float
) -> None:
    def fitting(mem: int) -> set[Configuration]:
        cluster = Cluster("c", 2, mem, Link(1e9, 1e-5), Link(1e8, 1e-5))
        found = search(SearchSpace(ranks=4, batch_size=16, max_microbatches=8), costs, cluster)
        return {p.config for p in found if p.fits}

    assert fitting(memory) <= fitting(int(memory * factor))


def test_a_periodic_sync_pays_one_weight_allreduce_per_period_and_runs_as_planned() -> None:
    """Local SGD and DiLoCo send no gradient after their start: a step pays, exposed, 1/H of
    one allreduce of the weights; the bytes per step are the weights' over H; DiLoCo keeps
    two more weight-sized buffers; and the row's ``train_args`` run that configuration."""
    from syncline.cli.main import build_parser, config_from_args

    costs = _uniform(4, params=2**20)
    compute = (1.0 + 2.0) * 4
    bw = 4 * 2**20 / 3  # a 4 MiB bucket takes 3 s (more than its layer's backward), the
    # 16 MiB of weights 12 s
    cluster = _cluster(bandwidth=bw)
    dense = predict(costs, cluster, Configuration(2, 2, bucket_cap_mb=4, first_bucket_cap_mb=4))
    for spec, h in (("localsgd:4:start=10", 4), ("diloco:6", 6)):
        p = predict(costs, cluster, Configuration(2, 2, sync=spec))
        assert p.breakdown["allreduce"] == pytest.approx(12 / h)
        assert p.step_s == pytest.approx(compute + 12 / h)
        assert p.gradient_wire_bytes == pytest.approx(4 * 4 * 2**20 / h)
        assert p.step_s < dense.step_s == pytest.approx(compute + 6)  # 2 of 4 buckets hidden
    extra = predict(costs, cluster, Configuration(2, 2, sync="diloco:6")).peak_bytes
    assert extra - predict(costs, cluster, Configuration(2, 2, sync="localsgd:6")).peak_bytes == (
        2 * 4 * 4 * 2**20
    )
    assert predict(costs, cluster, Configuration(1, 2, sync="diloco:6")).breakdown[
        "allreduce"
    ] == 0  # fmt: skip
    with pytest.raises(ConfigError, match="localsgd period=0 is invalid"):
        Configuration(2, 2, sync="localsgd:0")
    with pytest.raises(ConfigError, match="for data parallelism, not pipelines"):
        Configuration(2, 2, stages=2, schedule="gpipe", microbatches=2, sync="diloco:4")
    space = SearchSpace(ranks=2, batch_size=4, syncs=("every-step", "diloco:8"), pipelines=False)
    rows = to_json(search(space, costs, cluster), cluster, ["--model=gpt", "--n-layer=4"])
    periodic = [r for r in rows["candidates"] if r["sync"] == "diloco:8"]
    assert [r["label"] for r in periodic] == ["dp none sync diloco:8"]
    argv = ["train", *periodic[0]["model_args"], *periodic[0]["train_args"]]
    assert config_from_args(build_parser().parse_args(argv)).dp.sync == "diloco:8"
