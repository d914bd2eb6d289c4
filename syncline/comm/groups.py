"""Process-group lifecycle and small synchronous helpers, always with a timeout.

Why a layer of its own: every wait on another rank can hang forever when that rank dies, so
every group is created with an explicit timeout here and no other module creates one.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from syncline.comm.device import comm_device
from syncline.comm.topology import PipelineLayout, Ranks
from syncline.errors import CommError, CommTimeout, ConfigError

#: A process group handle; ``None`` means the default (world) group, as in torch.
Group = dist.ProcessGroup | None

_BACKENDS = ("gloo", "nccl")
_CPU = torch.device("cpu")


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
    timeout = datetime.timedelta(seconds=timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # [Note: one store namespace per attempt] Under torchrun the workers share the
        # agent's TCPStore, which lives across restarts; torch 2.13's env:// handler no longer
        # prefixes it per attempt, so a restarted worker could read a peer's gloo address
        # from the failed attempt and fail with "Connection refused" (seen with
        # --max-restarts). Each attempt gets its own namespace here.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        agent = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            int(os.environ["WORLD_SIZE"]),
            is_master=False,
            timeout=timeout,
        )
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"/syncline/attempt_{attempt}", agent),
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            timeout=timeout,
        )
    else:
        dist.init_process_group(backend, timeout=timeout)
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


def global_rank() -> int:
    """This process's rank in the default (world) group; 0 when no group is running."""
    return dist.get_rank() if is_initialized() else 0


def group_ranks(group: Group = None) -> Ranks:
    """The global ranks of ``group``'s members, in group-rank order."""
    if not is_initialized():
        return (0,)
    if group is None:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def is_member(group: Group) -> bool:
    """Whether this rank belongs to ``group`` (``new_group`` hands non-members a placeholder)."""
    return group is None or (is_initialized() and dist.get_rank(group) >= 0)


def build_pipeline_groups(num_stages: int, *, timeout_s: float = 300.0) -> tuple[Group, Group]:
    """Create every pipeline and data-parallel group (collective over the world: every rank
    calls it, same args); returns (this rank's pipeline group, this rank's data-parallel group).

    The layout is :class:`~syncline.comm.topology.PipelineLayout`'s: rank
    ``stage * width + replica``, so a stage's replicas are consecutive ranks (one node) and
    their gradient allreduce uses the fast links. ``torch.distributed.new_group`` is itself
    collective over the world, so every rank creates every group, in the same order (the
    pipelines, then the data-parallel groups), and keeps its own two.

    Args:
        num_stages: pipeline depth in ranks (interleaved: ranks per pipeline); must divide
            the world size.
        timeout_s: how long any operation on the new groups may wait.

    Raises:
        ConfigError: no default group is running, the world size is not divisible by
            ``num_stages``, or ``timeout_s`` is not positive (before any group is created).

    Example:
        >>> pipe_group, dp_group = build_pipeline_groups(2)  # 4 ranks: 2 stages x 2 replicas
        >>> Pipeline(model, num_stages=2, num_microbatches=4, loss_fn=lm_loss,
        ...          optimizer=opt, process_group=pipe_group, data_parallel_group=dp_group)
    """
    if not is_initialized():
        raise ConfigError("build_pipeline_groups needs a running default group; init it first")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or timeout_s <= 0:
        raise ConfigError(f"timeout_s={timeout_s!r} is invalid; valid: seconds > 0")
    layout = PipelineLayout(dist.get_world_size(), num_stages)
    rank = dist.get_rank()
    timeout = datetime.timedelta(seconds=timeout_s)
    mine: dict[str, Group] = {}
    for kind, groups in (
        ("pipeline", [layout.pipeline_ranks(i) for i in range(layout.width)]),
        ("data_parallel", [layout.data_parallel_ranks(s) for s in range(num_stages)]),
    ):
        for ranks in groups:
            group = dist.new_group(list(ranks), timeout=timeout)
            if rank in ranks:
                mine[kind] = group
    return mine["pipeline"], mine["data_parallel"]


def is_gloo(group: Group = None) -> bool:
    """Whether ``group`` runs on gloo (the host-side backend; also when no group is running).

    Every branch between gloo-only calls (``monitored_barrier``, sparse ``all_reduce``, timed
    host waits) and the rest goes through here, so a test can take the other branch by
    replacing :func:`backend_name`.
    """
    return backend_name(group) == "gloo"


def comm_error(rank: int, what: str, exc: BaseException, timeout_s: float | None) -> CommError:
    """``exc`` from torch.distributed as a :class:`CommError` naming ``rank`` and ``what``;
    a :class:`CommTimeout` when the backend says it timed out."""
    text = str(exc)
    first = text.splitlines()[0] if text else repr(exc)
    if timeout_s is not None and ("imeout" in text or "imed out" in text):
        return CommTimeout(f"rank {rank}: {what} did not complete within {timeout_s:.0f}s: {first}")
    return CommError(f"rank {rank}: {what} failed: {first}")


def barrier(
    group: Group = None,
    *,
    timeout_s: float | None = None,
    what: str = "barrier",
    device: torch.device | None = None,
) -> None:
    """Wait on the host until every rank of ``group`` arrives; name the rank and ``what`` when
    that fails or takes longer than ``timeout_s`` (``None``: the group's own timeout).

    gloo: ``monitored_barrier`` (it also names the ranks that did not arrive). It raises
    ``ValueError`` on every other backend, and NCCL's own ``dist.barrier`` guesses its device
    from the rank unless the group was bound to one; so elsewhere the barrier is a sum of one
    element on ``device`` (default: the group's bound device, else where :func:`comm_device`
    puts this backend's tensors), waited on the host.

    Raises:
        CommError: a peer failed; CommTimeout: ``timeout_s`` passed first.
    """
    if group_size(group) == 1:
        return
    try:
        if is_gloo(group):
            if timeout_s is None:
                dist.barrier(group=group)
            else:
                dist.monitored_barrier(group=group, timeout=datetime.timedelta(seconds=timeout_s))
        else:
            _allreduce_barrier(group, timeout_s, device)
    except (RuntimeError, ValueError) as exc:
        raise comm_error(global_rank(), what, exc, timeout_s) from exc


def _allreduce_barrier(group: Group, timeout_s: float | None, device: torch.device | None) -> None:
    """The barrier of a backend without ``monitored_barrier`` (NCCL): a one-element sum.

    With a timeout, ``Work.wait(timeout)`` polls on the host until the collective completes
    (NCCL) or the time is up; without one, ``Work.wait()`` under NCCL only makes the current
    stream wait, so the host then waits for that stream.
    """
    if device is None:
        pg = dist.GroupMember.WORLD if group is None else group
        bound = getattr(pg, "bound_device_id", None)
        device = bound if bound is not None else comm_device(backend_name(group), _CPU)
    token = torch.zeros(1, dtype=torch.int32, device=device)
    work = dist.all_reduce(token, group=group, async_op=True)
    if timeout_s is None:
        work.wait()
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
    elif work.wait(datetime.timedelta(seconds=timeout_s)) is False:
        raise RuntimeError(f"barrier timed out after {timeout_s:.0f}s")
