"""PURE: the settings of :class:`syncline.DataParallel`, each documented once.

Two dataclasses, because a setting is chosen in one form and run in another:

- :class:`DataParallelSettings` is what a user chooses by name: a compressor spec, an
  allreduce algorithm's name, bucket caps or "measured". It is the data-parallel part of
  :class:`syncline.train.config.TrainConfig` (``cfg.dp``), from whose fields ``syncline
  train``'s flags are generated; the trainer builds :class:`syncline.DataParallel`'s
  arguments from it (the compressor and the collective from their registries).
- :class:`DataParallelConfig` is what one engine runs with, resolved by its constructor
  from those arguments: concrete caps, whether and how the buckets are tuned, DDP's
  switches. Reusing it as the command line's part does not fit: its cap is a number where
  the command line's may be "measured", and it holds no compressor or algorithm (the
  engine is given objects for them, not names).

The bucket caps appear in both, in two forms: here they may be left to be measured
(``None``), there they are the sizes the engine cuts with. Every other setting is in one of
the two. The waits' ``timeout_s`` and ``precision`` are the run's, not data parallelism's
alone (a pipeline waits and casts too), so :class:`~syncline.train.config.TrainConfig`
holds them and gives them to either engine.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from syncline.comm.registry import ALLREDUCE
from syncline.dp.registry import COMPRESSORS, compressor_name, forms, parse
from syncline.dp.syncs import DEFAULT_SYNC, parse_sync, sync_forms
from syncline.errors import ConfigError
from syncline.fields import check_float, check_int, option

__all__ = ["GROUP", "PRECISIONS", "DataParallelConfig", "DataParallelSettings"]

#: ``precision``: fp32, or autocast in bf16 / fp16 (fp32 master weights; fp16 loss-scaled)
PRECISIONS = ("fp32", "bf16", "fp16")
#: the ``--help`` section of :class:`DataParallelSettings`
GROUP = "data parallelism"


@dataclass(frozen=True)
class DataParallelSettings:
    """Data parallelism as ``syncline train`` chooses it: by names, the caps possibly measured.

    Its compressor and allreduce algorithm also serve a pipeline's replicas (their REDUCE),
    which are data-parallel copies of one stage.
    """

    bucket_cap_mb: float | None = option(None, group=GROUP, default_text="measured")
    """Lazy-allreduce threshold in MiB. ``None``: measured: the engine tries a few bucket
    plans during the first ~50 steps and keeps the fastest (stateless compressors only;
    25 with one that keeps per-bucket state)."""
    first_bucket_cap_mb: float | None = option(None, group=GROUP, default_text="1, as DDP")
    """First bucket in MiB, small so communication starts early in backward."""
    compression: str = option("none", group=GROUP, metavar="SPEC", choices=lambda: forms())
    """Gradient compressor spec from the compressor registry, e.g. ``fp16`` or
    ``csc:0.01:warmup=20``; with pipelines it compresses the replicas' REDUCE."""
    allreduce: str = option("flat", group=GROUP, choices=ALLREDUCE.names)
    """A registered allreduce algorithm: ``flat`` (one ring) or ``hierarchical``
    (reduce-scatter in each node, allreduce across nodes, allgather in each node)."""
    ranks_per_node: int | None = option(None, group=GROUP, default_text="torchrun's local world")
    """Node size for ``hierarchical``; smaller values emulate several nodes on one machine."""
    sync: str = option(DEFAULT_SYNC, group=GROUP, metavar="SPEC", choices=lambda: sync_forms())
    """How often the replicas agree, from the sync registry: ``every-step`` (the gradients
    of every step averaged), ``localsgd:PERIOD[:start=N]`` (post-local SGD: N averaged steps,
    then local steps with the weights averaged every PERIOD) or ``diloco:H[:start=N]...``
    (DiLoCo: H local steps of the optimizer, then an outer Nesterov SGD step on the averaged
    weight change); data parallelism only."""

    def __post_init__(self) -> None:
        for name in ("bucket_cap_mb", "first_bucket_cap_mb"):
            if getattr(self, name) is not None:
                check_float(name, getattr(self, name), above=0)
        parse(self.compression)  # the name and the form; value ranges are the compressor's
        entry, _ = parse_sync(self.sync)
        if entry.periodic and COMPRESSORS.get(compressor_name(self.compression)).state_buffers:
            raise ConfigError(
                f"sync={self.sync!r} with compression={self.compression!r}: the compressor's "
                "per-rank residuals would never be sent once the gradients stop being "
                "averaged; valid: compression none, fp16 or bf16, or sync=every-step"
            )
        ALLREDUCE.get(self.allreduce)
        if self.ranks_per_node is not None:
            check_int("ranks_per_node", self.ranks_per_node)

    @property
    def periodic_sync(self) -> bool:
        """Whether the replicas step alone between synchronisations (``sync`` not every step)."""
        return parse_sync(self.sync)[0].periodic

    @property
    def owns_momentum(self) -> bool:
        """Whether the compressor applies momentum itself (so SGD must not)."""
        return COMPRESSORS.get(compressor_name(self.compression)).owns_momentum


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
        check_float("bucket_cap_mb", self.bucket_cap_mb, above=0)
        if self.first_bucket_cap_mb is not None:
            check_float("first_bucket_cap_mb", self.first_bucket_cap_mb, above=0)
        check_float("timeout_s", self.timeout_s, above=0)
        check_float("tune_min_bucket_mb", self.tune_min_bucket_mb, above=0)
        check_float("tune_keep_margin", self.tune_keep_margin, at_least=0, finite=False)
        for name in ("tune_steps_per_trial", "tune_rounds", "tune_final_rounds"):
            check_int(name, getattr(self, name))

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
