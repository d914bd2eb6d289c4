"""PURE: the settings of :class:`syncline.DataParallel`, each documented once."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from syncline.errors import ConfigError
from syncline.fields import check_positive

__all__ = ["PRECISIONS", "DataParallelConfig"]

#: ``precision``: fp32, or autocast in bf16 / fp16 (fp32 master weights; fp16 loss-scaled)
PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class DataParallelConfig:
    """Settings of :class:`syncline.DataParallel` (DDP's keywords and syncline's own)."""

    bucket_cap_mb: float = 25.0
    """Lazy-allreduce threshold: a bucket is launched once its gradients (in MiB) are ready.
    Larger means fewer, larger collectives; smaller, more overlap with backward."""
    first_bucket_cap_mb: float | None = None
    """Cap of the first bucket, kept small so that communication starts early in backward
    (DDP's choice); ``None`` means 1 MiB."""
    broadcast_buffers: bool = True
    """Give every rank rank 0's current buffers (e.g. BatchNorm statistics) before each
    forward that follows a synchronised training forward, as DDP does (its
    ``forward_sync_buffers``): one packed broadcast, written without bumping the buffers'
    version counters."""
    find_unused_parameters: bool = False
    """Allow parameters that get no gradient in a step; they are reduced as zeros, and a
    parameter unused on every rank keeps the gradient it had (``None`` stays ``None``)."""
    rebuild_buckets: bool = True
    """After the first synchronised backward, re-lay the flat buffer in the order gradients
    actually became ready (rank 0's order, broadcast to all)."""
    timeout_s: float = 300.0
    """How long any wait on other ranks may take before it fails with the rank, step and
    operation in the message."""
    autotune_buckets: bool = False
    """Measure a few bucket plans during the first steps and keep the fastest
    (:mod:`syncline.dp.tuning`); the caps above are then the first candidate.
    ``DataParallel`` turns it on when no cap was given and the compressor is stateless."""
    tune_steps_per_trial: int = 2
    """Synchronised steps each candidate plan runs per round of the screening."""
    tune_rounds: int = 2
    """Rounds of the screening, every candidate once per round."""
    tune_final_rounds: int = 4
    """Further rounds for the candidates that survive the screening (successive halving)."""
    tune_keep_margin: float = 0.05
    """A candidate survives the screening when its median is within this fraction of the
    best one's."""
    tune_min_bucket_mb: float = 0.125
    """The smallest even cap tried."""

    def __post_init__(self) -> None:
        check_positive("bucket_cap_mb", self.bucket_cap_mb)
        if self.first_bucket_cap_mb is not None:
            check_positive("first_bucket_cap_mb", self.first_bucket_cap_mb)
        check_positive("timeout_s", self.timeout_s)
        check_positive("tune_min_bucket_mb", self.tune_min_bucket_mb)
        if not self.tune_keep_margin >= 0:
            raise ConfigError(f"tune_keep_margin={self.tune_keep_margin!r} must be >= 0")
        for name in ("tune_steps_per_trial", "tune_rounds", "tune_final_rounds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r} must be an integer >= 1")

    @property
    def cap_bytes(self) -> int:
        """The bucket cap in bytes."""
        return max(1, int(self.bucket_cap_mb * 2**20))

    @property
    def first_cap_bytes(self) -> int:
        """The first bucket's cap in bytes (see ``first_bucket_cap_mb``)."""
        first = 1.0 if self.first_bucket_cap_mb is None else self.first_bucket_cap_mb
        return max(1, int(min(first, self.bucket_cap_mb) * 2**20))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
