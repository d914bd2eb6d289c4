"""The only layer that calls ``torch.distributed``: groups, collectives, timeouts, topology.

Names resolve lazily, so the pure :mod:`syncline.comm.topology` imports without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from syncline.comm.collectives import (
        Collective,
        FlatAllreduce,
        GradBucket,
        PackedBroadcast,
        Pending,
        allgather_objects,
        allreduce_sparse,
        broadcast_tensors,
        broadcast_tensors_async,
        completed,
        gather_objects,
        open_lane,
        with_lane,
    )
    from syncline.comm.groups import (
        Group,
        backend_name,
        barrier,
        build_pipeline_groups,
        destroy,
        global_rank,
        group_rank,
        group_ranks,
        group_size,
        init_from_env,
        init_with_file_store,
        is_initialized,
        is_member,
    )
    from syncline.comm.hierarchical import HierarchicalAllreduce
    from syncline.comm.registry import ALLREDUCE, AllreduceSpec, build_allreduce
    from syncline.comm.topology import (
        PipelineLayout,
        Topology,
        bus_bandwidth,
        hierarchical_allreduce_time,
        pipeline_grid,
        ring_allreduce_time,
    )

_EXPORTS = {
    **dict.fromkeys(
        [
            "Collective",
            "FlatAllreduce",
            "GradBucket",
            "PackedBroadcast",
            "Pending",
            "allgather_objects",
            "allreduce_sparse",
            "broadcast_tensors",
            "build_allreduce",
            "broadcast_tensors_async",
            "completed",
            "gather_objects",
            "open_lane",
            "with_lane",
        ],
        "syncline.comm.collectives",
    ),
    **dict.fromkeys(
        [
            "Group",
            "backend_name",
            "barrier",
            "build_pipeline_groups",
            "destroy",
            "global_rank",
            "group_rank",
            "group_ranks",
            "group_size",
            "init_from_env",
            "init_with_file_store",
            "is_initialized",
            "is_member",
        ],
        "syncline.comm.groups",
    ),
    "HierarchicalAllreduce": "syncline.comm.hierarchical",
    "ALLREDUCE": "syncline.comm.registry",
    "AllreduceSpec": "syncline.comm.registry",
    "build_allreduce": "syncline.comm.registry",
    **dict.fromkeys(
        [
            "PipelineLayout",
            "Topology",
            "bus_bandwidth",
            "hierarchical_allreduce_time",
            "pipeline_grid",
            "ring_allreduce_time",
        ],
        "syncline.comm.topology",
    ),
}
__all__ = [
    "ALLREDUCE",
    "AllreduceSpec",
    "Collective",
    "FlatAllreduce",
    "GradBucket",
    "Group",
    "HierarchicalAllreduce",
    "PackedBroadcast",
    "Pending",
    "PipelineLayout",
    "Topology",
    "allgather_objects",
    "allreduce_sparse",
    "backend_name",
    "barrier",
    "broadcast_tensors",
    "broadcast_tensors_async",
    "build_allreduce",
    "build_pipeline_groups",
    "bus_bandwidth",
    "completed",
    "destroy",
    "gather_objects",
    "global_rank",
    "group_rank",
    "group_ranks",
    "group_size",
    "hierarchical_allreduce_time",
    "init_from_env",
    "init_with_file_store",
    "is_initialized",
    "is_member",
    "open_lane",
    "pipeline_grid",
    "ring_allreduce_time",
    "with_lane",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'syncline.comm' has no attribute {name!r}")
