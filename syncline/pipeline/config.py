"""PURE: the settings of :class:`syncline.Pipeline`, each documented once, checked on creation.

The schedule's own rules (micro-batches against stages, stages per rank) come from its entry
in :data:`syncline.schedule.SCHEDULES`, so a registered schedule is checked like a built-in.

Two dataclasses, because a pipeline is chosen in one form and run in another:

- :class:`PipelineSettings` is what a user chooses: ranks per pipeline (1: none), and the
  micro-batches, schedule and balance, each possibly left to a default resolved here. It is
  the pipeline part of :class:`syncline.train.config.TrainConfig` (``cfg.pipeline``), from
  whose fields ``syncline train``'s flags are generated.
- :class:`PipelineConfig` is what one :class:`syncline.Pipeline` runs, as its constructor
  builds it beside the model, loss and process groups: the stages counted as the plan
  counts them (an interleaved schedule's virtual stages), the micro-batches resolved.
  Reusing it as the command line's part does not fit: it has no "no pipeline", and its
  ``num_stages`` is not the ranks a user names. The trainer builds the constructor's
  arguments from the settings (``num_stages=settings.virtual_stages``). ``schedule``,
  ``recompute`` and ``balance`` appear in both with one meaning, resolved there.

What needs the model or the world (layers to cut, ranks to divide) is checked by the whole
:class:`~syncline.train.config.TrainConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass

from syncline.dp.config import PRECISIONS
from syncline.errors import ConfigError
from syncline.fields import check_float, check_int, option
from syncline.models.factory import split_names
from syncline.schedule.registry import SCHEDULES, ScheduleSpec, check_microbatches

__all__ = ["DEFAULT_SCHEDULE", "GROUP", "PipelineConfig", "PipelineSettings"]

#: the schedule when none is named (PipeDream-Flush: 1F1B's memory, no weight versions)
DEFAULT_SCHEDULE = "1f1b"
#: the ``--help`` section of :class:`PipelineSettings`
GROUP = "pipeline parallelism"


def _layers_per_stage(text: str) -> tuple[int, ...]:
    """``--balance 2,3`` as ``(2, 3)``; sizes are checked against the model on creation."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(
            f"balance={text!r} is not a comma-separated list of layers per stage, e.g. 2,2"
        ) from None


@dataclass(frozen=True)
class PipelineSettings:
    """A pipeline as ``syncline train`` chooses it; ``pipeline_stages=1``: none.

    The defaults are resolved on creation (``schedule``: ``1f1b``, ``microbatches``: 2 x D)
    when there is a pipeline, and stay ``None`` when there is none.
    """

    pipeline_stages: int = option(1, group=GROUP, metavar="D")
    """D, ranks per pipeline; 1 trains with data parallelism only. The world is D x
    replicas (global rank = stage x replicas + replica)."""
    microbatches: int | None = option(None, group=GROUP, metavar="M", default_text="2 x D")
    """Micro-batches per batch of a replica; must divide it; the schedule may constrain it."""
    schedule: str | None = option(
        None, group=GROUP, metavar="NAME", choices=SCHEDULES.names, default_text=DEFAULT_SCHEDULE
    )
    """A registered pipeline schedule (:data:`syncline.schedule.SCHEDULES`)."""
    recompute: bool = option(False, group=GROUP)
    """Keep only stage inputs and recompute each forward before its backward (less
    activation memory, about one more forward of compute)."""
    balance: tuple[int, ...] | None = option(
        None, group=GROUP, metavar="N,N,...", parse=_layers_per_stage, default_text="profiled"
    )
    """Layers per (virtual) stage, summing to the model's layers; ``None`` profiles the
    layers on the first micro-batch and balances their times."""
    split_points: tuple[str, ...] | None = option(
        None, group=GROUP, metavar="NAME,NAME", parse=split_names, default_text="none"
    )
    """For a factory's model that is no ``nn.Sequential``: the modules (names from
    ``named_modules()``, e.g. ``transformer.h.2``) where stages 2, 3, ... begin; the model
    is traced and cut there (torch's pipeline splitter), called as ``model(**{its forward's
    first argument: inputs})``."""

    def __post_init__(self) -> None:
        d = check_int("pipeline_stages", self.pipeline_stages)
        if d == 1:
            if self.microbatches is not None or any(
                (self.schedule, self.recompute, self.balance, self.split_points)
            ):
                raise ConfigError(
                    "microbatches, schedule, recompute, balance and split_points need "
                    "pipeline_stages > 1 "
                    f"(got pipeline_stages={d}); add --pipeline-stages D"
                )
            return
        schedule = self.schedule or DEFAULT_SCHEDULE
        SCHEDULES.get(schedule)
        m = check_int("microbatches", 2 * d if self.microbatches is None else self.microbatches)
        object.__setattr__(self, "schedule", schedule)
        object.__setattr__(self, "microbatches", m)
        if self.balance is not None:
            object.__setattr__(self, "balance", tuple(self.balance))
        if self.split_points is not None:
            object.__setattr__(self, "split_points", tuple(self.split_points))
        check_microbatches(schedule, d, m, m_name="microbatches", d_name="pipeline_stages")

    @property
    def pipelined(self) -> bool:
        """Whether the model is split into a pipeline (``pipeline_stages > 1``)."""
        return self.pipeline_stages > 1

    @property
    def schedule_spec(self) -> ScheduleSpec | None:
        """The schedule's registry entry, or ``None`` without a pipeline."""
        return SCHEDULES.get(self.schedule) if self.schedule else None

    @property
    def virtual_stages(self) -> int:
        """Stages of the pipeline: ``pipeline_stages`` times the schedule's stages per rank."""
        spec = self.schedule_spec
        return self.pipeline_stages * (spec.stages_per_rank if spec else 1)


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
        d = check_int("num_stages", self.num_stages)
        m = check_int("num_microbatches", self.num_microbatches)
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
        check_float("reduce_bucket_mb", self.reduce_bucket_mb, at_least=0, finite=False)
        check_float("timeout_s", self.timeout_s, above=0)
