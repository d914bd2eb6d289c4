"""PURE (torch loaded only when GPUs are counted): a node's backend, its ranks' device kind,
how many ranks it starts, and what it refuses, decided before any rank starts."""

from __future__ import annotations

from syncline.errors import ConfigError

__all__ = [
    "CPU_NPROC_PER_NODE",
    "default_nproc_per_node",
    "device_kind",
    "refuse_emulated_nccl",
    "resolved_backend",
    "visible_gpus",
]

#: ranks per node on a machine without GPUs (or with ``--backend gloo``) when none is given
CPU_NPROC_PER_NODE = 2


def visible_gpus() -> int:
    """GPUs this process sees (0 without CUDA, or without a working driver); torch is loaded
    only when asked, so the CLI's pure checks stay cheap. Tests replace it to play a GPU
    node on a CPU machine."""
    try:
        import torch

        return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    except Exception:  # a broken driver is a node without GPUs, as torch's own checks say
        return 0


def resolved_backend(backend: str, gpus: int) -> str:
    """The process-group backend ``backend`` stands for on a node with ``gpus`` visible GPUs:
    ``auto`` is ``nccl`` with GPUs, else ``gloo``; the others are themselves."""
    if backend == "auto":
        return "nccl" if gpus > 0 else "gloo"
    return backend


def device_kind(backend: str) -> str:
    """The device a rank computes on under a resolved ``backend``: ``cuda`` under NCCL (which
    takes CUDA tensors only), ``cpu`` under gloo."""
    return "cuda" if backend == "nccl" else "cpu"


def default_nproc_per_node(backend: str, gpus: int) -> int:
    """Ranks per node when ``--nproc-per-node`` is not given: one per visible GPU when the
    ranks train on GPUs (``backend`` resolves to NCCL), else :data:`CPU_NPROC_PER_NODE`.

    Example:
        >>> default_nproc_per_node("auto", 8), default_nproc_per_node("gloo", 8)
        (8, 2)
    """
    resolved = resolved_backend(backend, gpus)
    return gpus if resolved == "nccl" and gpus > 0 else CPU_NPROC_PER_NODE


def refuse_emulated_nccl(rate: str, why: str) -> None:
    """``--emulate-network`` under NCCL, refused (``why``: how the backend came to be NCCL).

    Raises:
        ConfigError: always, naming the reasons and what is valid.
    """
    raise ConfigError(
        f"emulate_network={rate!r} with backend nccl ({why}) is not supported: each emulated "
        "node runs one rank, so every rank would be LOCAL_RANK 0 on cuda:0, and NCCL ignores "
        "GLOO_SOCKET_IFNAME, so its traffic would bypass the emulated links; valid: "
        "--backend gloo (the ranks train on the CPU)"
    )
