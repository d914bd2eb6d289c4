"""The only layer that calls ``torch.distributed``: groups, collectives, timeouts."""

from syncline.comm.collectives import (
    Collective,
    FlatAllreduce,
    Pending,
    broadcast_tensors,
    broadcast_tensors_async,
    completed,
)
from syncline.comm.groups import (
    Group,
    backend_name,
    barrier,
    destroy,
    group_rank,
    group_size,
    init_from_env,
    init_with_file_store,
    is_initialized,
)

__all__ = [
    "Collective",
    "FlatAllreduce",
    "Group",
    "Pending",
    "backend_name",
    "barrier",
    "broadcast_tensors",
    "broadcast_tensors_async",
    "completed",
    "destroy",
    "group_rank",
    "group_size",
    "init_from_env",
    "init_with_file_store",
    "is_initialized",
]
