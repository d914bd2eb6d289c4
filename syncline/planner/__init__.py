"""PURE (no torch): the planner: a cost model over syncline's own schedules, and a search.

``syncline plan`` measures (or reads) a :class:`Cluster` and the model's :class:`ModelCosts`,
predicts every configuration of data parallelism and pipelines with :func:`predict`, and
ranks them with :func:`search`.

Example:
    >>> from syncline.planner import Cluster, Link, SearchSpace, search, transformer_costs
    >>> cluster = Cluster("v100", 8, "16GiB", Link("1200gbit"), Link("25gbit"), 1e14)
    >>> costs = transformer_costs(n_layer=24, n_embd=1024, n_head=16, seq_len=512,
    ...                           vocab_size=50257, flops_per_s=cluster.flops_per_s)
    >>> best = search(SearchSpace(ranks=8, batch_size=64), costs, cluster)[0]
"""

from __future__ import annotations

from syncline.planner.costs import Affine, LayerCost, ModelCosts, transformer_costs
from syncline.planner.device import Device
from syncline.planner.hardware import Cluster, Link, parse_bandwidth, parse_size
from syncline.planner.predict import Configuration, Prediction, predict
from syncline.planner.search import SearchSpace, candidates, search, table, to_json

__all__ = [
    "Affine",
    "Cluster",
    "Configuration",
    "Device",
    "LayerCost",
    "Link",
    "ModelCosts",
    "Prediction",
    "SearchSpace",
    "candidates",
    "parse_bandwidth",
    "parse_size",
    "predict",
    "search",
    "table",
    "to_json",
    "transformer_costs",
]
