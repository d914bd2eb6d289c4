"""The only layer that calls ``torch.distributed``: groups, collectives, timeouts."""

from syncline.comm.collectives import Collective, FlatAllreduce, Pending
from syncline.comm.groups import (
    Group,
    backend_name,
    barrier,
    broadcast_tensors,
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
    "destroy",
    "group_rank",
    "group_size",
    "init_from_env",
    "init_with_file_store",
    "is_initialized",
]
