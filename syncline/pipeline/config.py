"""PURE: the settings of :class:`syncline.Pipeline`, each documented once, checked on creation.

The schedule's own rules (micro-batches against stages, stages per rank) come from its entry
in :data:`syncline.schedule.SCHEDULES`, so a registered schedule is checked like a built-in.
"""

from __future__ import annotations

from dataclasses import dataclass

from syncline.dp.config import PRECISIONS
from syncline.errors import ConfigError
from syncline.fields import check_positive
from syncline.schedule.registry import SCHEDULES, check_microbatches

__all__ = ["DEFAULT_SCHEDULE", "PipelineConfig"]

#: the schedule when none is named (PipeDream-Flush: 1F1B's memory, no weight versions)
DEFAULT_SCHEDULE = "1f1b"


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} is invalid; valid: an int >= 1")
    return value


@dataclass(frozen=True)
class PipelineConfig:
    """What :class:`syncline.Pipeline` runs (the model, loss and groups are its arguments)."""

    num_stages: int
    """Pipeline depth: the group's size, or for an interleaved schedule a multiple >= 2 of
    it (``num_stages // size`` stages per rank)."""
    num_microbatches: int
    """Micro-batches per batch; the schedule may constrain it (2BW: at least the stages)."""
    schedule: str = DEFAULT_SCHEDULE
    """A registered schedule (:data:`syncline.schedule.SCHEDULES`): ``gpipe``, ``1f1b``
    (PipeDream-Flush), ``2bw`` (PipeDream-2BW), ``interleaved`` or a plug-in's."""
    recompute: bool = False
    """Keep only stage inputs and recompute each forward before its backward."""
    balance: tuple[int, ...] | None = None
    """Layers per stage; ``None``: profile the layers on the first micro-batch and balance."""
    timeout_s: float = 300.0
    """The longest any wait on another rank may take."""
    precision: str = "fp32"
    """``fp32``, or ``bf16`` / ``fp16`` autocast (fp16 with loss scaling every rank agrees
    on; :mod:`syncline.pipeline.precision`)."""
    reduce_bucket_mb: float = 4.0
    """With replicas: the REDUCE's bucket size in MiB, ``0`` for one bucket per stage."""

    def __post_init__(self) -> None:
        d = _check_int("num_stages", self.num_stages)
        m = _check_int("num_microbatches", self.num_microbatches)
        if not SCHEDULES.get(self.schedule).interleaved:  # (interleaved: checked by the plan)
            check_microbatches(self.schedule, d, m, m_name="num_microbatches", d_name="num_stages")
        if not isinstance(self.recompute, bool):
            raise ConfigError(f"recompute={self.recompute!r} is invalid; valid: True or False")
        if isinstance(self.balance, list):
            object.__setattr__(self, "balance", tuple(self.balance))
        if self.precision not in PRECISIONS:
            raise ConfigError(
                f"precision={self.precision!r} is invalid; valid: {', '.join(PRECISIONS)}"
            )
        bucket = self.reduce_bucket_mb
        if isinstance(bucket, bool) or not isinstance(bucket, int | float) or not bucket >= 0:
            raise ConfigError(
                f"reduce_bucket_mb={bucket!r} is invalid; valid: MiB >= 0 (0: one per stage)"
            )
        try:
            check_positive("timeout_s", self.timeout_s)
        except ConfigError:
            raise ConfigError(
                f"timeout_s={self.timeout_s!r} is invalid; valid: seconds > 0"
            ) from None
