"""PURE: the schedule registry: every pipeline schedule and all that others need to know of it.

An entry holds the schedule's generator (or, for schedules that are never flushed, the
builder of its call slices), its constraint on micro-batches, how many stages a rank may
hold and whether it keeps weight versions. Configuration checks, ``--help``, the plan
builder and the runtime all read the entry; adding a schedule is one generator plus one
``SCHEDULES.register(ScheduleSpec(...))``.

Example:
    >>> from syncline.schedule import SCHEDULES, ScheduleSpec, gpipe
    >>> SCHEDULES.register(ScheduleSpec("my-gpipe", "GPipe again", generate=lambda d, m,
    ...     chunks, recompute: gpipe(d, m, recompute=recompute)))
    >>> build_plan("my-gpipe", num_ranks=2, num_stages=2, num_microbatches=4).name
    'my-gpipe'
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from syncline.errors import ConfigError
from syncline.fields import check_int
from syncline.registry import Registry
from syncline.schedule.generators import gpipe, interleaved_1f1b, one_f_one_b
from syncline.schedule.ir import Schedule
from syncline.schedule.plan import Plan, flush_plan, two_bw_plan

__all__ = ["SCHEDULES", "ScheduleSpec", "build_plan", "check_microbatches"]

#: ``(num_ranks, num_microbatches, stages_per_rank, recompute) -> one batch's actions``
Generator = Callable[[int, int, int, bool], Schedule]
#: ``(name, num_ranks, num_microbatches, recompute) -> Plan`` for schedules never flushed
PlanBuilder = Callable[[str, int, int, bool], Plan]
#: ``(num_ranks, num_microbatches) -> None`` when valid, else what M must be, with ``{D}``
#: standing for the ranks (e.g. ``">= {D}"``), worded into the caller's own names
Rule = Callable[[int, int], str | None]


def _any_m(d: int, m: int) -> str | None:
    del d, m
    return None


@dataclass(frozen=True)
class ScheduleSpec:
    """One pipeline schedule, as everything outside its generator sees it.

    Attributes:
        name: what ``schedule=`` and ``--schedule`` take.
        summary: one line for ``--help``: what it does, whose it is.
        generate: a flush schedule's generator; one call of ``train_step`` runs its list.
        plan: for schedules that are never flushed (2BW), the builder of the slices that
            consecutive calls run (:mod:`syncline.schedule.plan`); then ``generate`` is unused.
        rule: the constraint on micro-batches M for D ranks: ``None``, or what M must be.
        rule_text: the same rule for ``--help``, e.g. ``"M >= D"``.
        stages_per_rank: stages (virtual stages) a rank holds when the command line builds
            the pipeline; ``> 1`` also lets ``Pipeline`` take any multiple >= 2 of the ranks.
        versioned: keeps two weight versions and updates them one step late (2BW); the
            runtime stashes weights by version.
    """

    name: str
    summary: str
    generate: Generator | None = None
    plan: PlanBuilder | None = None
    rule: Rule = _any_m
    rule_text: str = ""
    stages_per_rank: int = 1
    versioned: bool = False

    def __post_init__(self) -> None:
        if (self.generate is None) == (self.plan is None):
            raise ConfigError(
                f"schedule {self.name!r} needs exactly one of generate= (a flush schedule) "
                "and plan= (the call slices of a schedule that is never flushed)"
            )
        check_int(f"schedule {self.name!r}: stages_per_rank", self.stages_per_rank)

    @property
    def interleaved(self) -> bool:
        """Whether a rank holds several (virtual) stages."""
        return self.stages_per_rank > 1


SCHEDULES: Registry[ScheduleSpec] = Registry("schedule")


def check_microbatches(
    name: str, num_ranks: int, num_microbatches: int, *, m_name: str, d_name: str
) -> None:
    """Raise :class:`ConfigError` when ``num_microbatches`` does not fit schedule ``name``.

    ``m_name`` and ``d_name`` are what the caller calls the two sizes, so the message names
    the caller's own settings, e.g. ``microbatches=1 must be >= pipeline_stages=2 for 2bw``.
    """
    why = SCHEDULES.get(name).rule(num_ranks, num_microbatches)
    if why is not None:
        need = why.format(D=f"{d_name}={num_ranks}")
        raise ConfigError(f"{m_name}={num_microbatches} must be {need} for {name}")


def build_plan(
    name: str, num_ranks: int, num_stages: int, num_microbatches: int, *, recompute: bool = False
) -> Plan:
    """Generate, validate and slice the schedule ``name``.

    Args:
        name: a registered schedule.
        num_ranks: ranks in the pipeline group.
        num_stages: stages; equal to ``num_ranks`` unless the schedule is interleaved (then a
            multiple >= 2 of it).
        num_microbatches: micro-batches per batch.
        recompute: RECOMPUTE before each BACKWARD.

    Raises:
        ConfigError: an unknown name or sizes that do not fit the schedule, naming them.
    """
    spec = SCHEDULES.get(name)
    d, m = num_ranks, num_microbatches
    if spec.interleaved:
        if d < 2:  # stage s runs on rank s % d: adjacent stages would share the one rank
            raise ConfigError(
                f"schedule={name!r} on a group of {d} rank: adjacent stages would run on the "
                "same rank and message themselves; valid: a group of >= 2 ranks, or a flush "
                "schedule (gpipe, 1f1b) with num_stages=1"
            )
        if num_stages % d or num_stages // d < 2:
            raise ConfigError(
                f"schedule={name!r} needs num_stages a multiple >= 2 of the {d} ranks "
                f"(stages per rank), got num_stages={num_stages}"
            )
    elif num_stages != d:
        raise ConfigError(
            f"num_stages={num_stages} must equal the process group's size {d} for "
            f"schedule={name!r} (one stage per rank)"
        )
    ranks = "num_ranks" if spec.interleaved else "num_stages"  # equal unless interleaved
    check_microbatches(name, d, m, m_name="num_microbatches", d_name=ranks)
    if spec.plan is not None:
        return spec.plan(name, d, m, recompute)
    assert spec.generate is not None
    return flush_plan(name, spec.generate(d, m, num_stages // d, recompute))


def _at_least_d(d: int, m: int) -> str | None:
    return None if m >= d else ">= {D}"


def _multiple_of_d(d: int, m: int) -> str | None:
    return None if m % d == 0 else "a multiple of {D}"


SCHEDULES.register(
    ScheduleSpec(
        "gpipe",
        "GPipe (Huang et al. 2019): all forwards, then all backwards, then the flush",
        generate=lambda d, m, chunks, recompute: gpipe(d, m, recompute=recompute),
    )
)
SCHEDULES.register(
    ScheduleSpec(
        "1f1b",
        "PipeDream-Flush (Narayanan et al. 2021): one forward, one backward, then the flush",
        generate=lambda d, m, chunks, recompute: one_f_one_b(d, m, recompute=recompute),
    )
)
SCHEDULES.register(
    ScheduleSpec(
        "2bw",
        "PipeDream-2BW (Narayanan et al. 2021): 1F1B never flushed, two weight versions",
        plan=two_bw_plan,
        rule=_at_least_d,
        rule_text="M >= D",
        versioned=True,
    )
)
SCHEDULES.register(
    ScheduleSpec(
        "interleaved",
        "interleaved 1F1B (Megatron-LM, Narayanan et al. 2021): virtual stages per rank",
        generate=lambda d, m, chunks, recompute: interleaved_1f1b(
            d, m, chunks, recompute=recompute
        ),
        rule=_multiple_of_d,
        rule_text="M a multiple of D",
        stages_per_rank=2,
    )
)
