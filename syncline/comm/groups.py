"""Process-group lifecycle and small synchronous helpers, always with a timeout.

Why a layer of its own: every wait on another rank can hang forever when that rank dies, so
every group is created with an explicit timeout here and no other module creates one.
"""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist

from syncline.errors import CommError, ConfigError

#: A process group handle; ``None`` means the default (world) group, as in torch.
Group = dist.ProcessGroup | None

_BACKENDS = ("gloo", "nccl")


def _check_backend(backend: str) -> None:
    if backend not in _BACKENDS:
        raise ConfigError(f"backend={backend!r} is not supported; valid: {', '.join(_BACKENDS)}")


def init_with_file_store(
    path: str, rank: int, world_size: int, *, backend: str = "gloo", timeout_s: float = 120.0
) -> None:
    """Start the default group from a shared file (tests, benchmarks): no ports, no races.

    Args:
        path: a file path every rank can see; it must not exist before the first rank starts.
        rank: this process's rank, ``0 <= rank < world_size``.
        world_size: number of processes.
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (GPU).
        timeout_s: how long any collective may wait before it fails.
    """
    _check_backend(backend)
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank={rank} must be in [0, world_size={world_size})")
    store = dist.FileStore(path, world_size)
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def init_from_env(*, backend: str = "gloo", timeout_s: float = 300.0) -> tuple[int, int]:
    """Start the default group from the variables ``torchrun`` sets; returns (rank, world).

    Only the launcher-facing code calls this: it is the one place that reads ``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``.
    """
    _check_backend(backend)
    missing = [
        k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ
    ]
    if missing:
        raise CommError(
            f"environment variables {missing} are not set; start the job with torchrun "
            "or `syncline train`"
        )
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def destroy() -> None:
    if is_initialized():
        dist.destroy_process_group()


def backend_name(group: Group = None) -> str:
    """``"gloo"``, ``"nccl"``, ... of ``group``; ``"gloo"`` when no group is running."""
    return str(dist.get_backend(group)) if is_initialized() else "gloo"


def group_rank(group: Group = None) -> int:
    return dist.get_rank(group) if is_initialized() else 0


def group_size(group: Group = None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def barrier(group: Group = None, *, timeout_s: float | None = None, what: str = "barrier") -> None:
    """A barrier that names the rank and purpose when it times out."""
    if group_size(group) == 1:
        return
    try:
        if timeout_s is None:
            dist.barrier(group=group)
        else:
            dist.monitored_barrier(group=group, timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise CommError(f"rank {group_rank(group)}: {what} failed: {exc}") from exc
