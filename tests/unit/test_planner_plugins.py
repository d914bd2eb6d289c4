"""A compressor or optimizer a plug-in registers is planned like a built-in: the planner
reads what it needs (traffic per bucket, state buffers) from the registry entries."""

from __future__ import annotations

import pytest

from syncline.dp.registry import COMPRESSORS, CompressorSpec
from syncline.errors import ConfigError
from syncline.planner import Cluster, Link, SearchSpace, search
from syncline.planner.collectives import Phase, bucket_phases
from syncline.planner.search import default_compressions, table
from tests.plugins import toy_plugin_registered
from tests.unit.test_planner import _uniform


@pytest.fixture
def plugin():
    with toy_plugin_registered() as toy:
        yield toy


def test_a_plugin_compressor_is_searched_and_shown_with_its_predicted_bytes(plugin) -> None:
    assert "toymean" in default_compressions()
    assert bucket_phases("toymean", 1000) == [Phase("allreduce", 4000)]
    costs = _uniform(4, params=100_000)
    cluster = Cluster("small", 2, 2**34, Link(1e9, 1e-5), Link(1e9, 1e-5))
    space = SearchSpace(ranks=4, batch_size=16, pipelines=False, optimizer="sgd")
    found = search(space, costs, cluster)
    rows = {p.config.compression: p for p in found}
    assert rows["toymean"].gradient_wire_bytes == 4 * 4 * 100_000  # 4 layers, fp32, dense
    assert rows["fp16"].gradient_wire_bytes == 2 * 4 * 100_000
    assert rows["csc:0.01"].gradient_wire_bytes < rows["fp16"].gradient_wire_bytes / 10
    text = table(found, top=len(found))
    assert "dp toymean" in text and "1.5 MiB" in text  # 1.6e6 bytes, its predicted traffic


def test_a_compressor_without_a_traffic_model_is_refused_by_name_and_not_searched() -> None:
    COMPRESSORS.register(CompressorSpec("opaque", "no traffic model", "x:y"), replace=True)
    try:
        assert "opaque" not in default_compressions()
        with pytest.raises(ConfigError, match=r"no traffic model for 'opaque'.*valid: none"):
            bucket_phases("opaque", 10)
    finally:
        COMPRESSORS.unregister("opaque")
