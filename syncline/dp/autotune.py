"""Bucket tuning in a running engine: measure candidate plans in turn, agree, keep the best.

:mod:`syncline.dp.tuning` (pure) says which plans to try, in which order, and how to pick one
from measured times; this module runs that over a live :class:`~syncline.dp.layout.GradBuffer`:
it re-cuts the buffer before each trial, records each synchronised backward's time, combines
the ranks' times through the engine's collective (so every rank picks the same plan), and
adopts the choice. Only where the buffer is cut changes, never the result.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

import torch

from syncline.comm.collectives import Collective, host_list
from syncline.dp.buckets import BucketPlan
from syncline.dp.config import DataParallelConfig
from syncline.dp.layout import GradBuffer
from syncline.dp.tuning import (
    BucketCandidate,
    TuningSchedule,
    bucket_candidates,
    choose,
    min_over_ranks,
    survivors,
)

__all__ = ["BucketTuning"]


@dataclass
class _Tuner:
    """Bucket tuning in progress: the candidates, their plans over the buffer, the times."""

    candidates: list[BucketCandidate]
    plans: list[BucketPlan]
    schedule: TuningSchedule  # over positions in ``racing``
    racing: list[int]  # candidates measured in this phase
    screening: bool = True  # first phase: every candidate; then the close ones
    active: int = 0
    samples: list[list[float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.samples = [[] for _ in self.candidates]


class BucketTuning:
    """Chooses where ``buffer`` is cut into buckets, by measurement, during the first steps.

    Args:
        config: the engine's settings (``autotune_buckets`` and the ``tune_*`` fields).
        buffer: the flat buffer whose buckets are re-cut; its ``caps`` end as the choice's.
        collective: the engine's collective, through which the ranks' times are combined.
        device: where the times travel (the communication device of the collective's group;
            default: the buffer's device).

    Attributes:
        result: ``None`` until decided; then the choice and every candidate's measurements
            (the engine's ``bucket_tuning``).
    """

    def __init__(
        self,
        config: DataParallelConfig,
        buffer: GradBuffer,
        collective: Collective,
        device: torch.device | None = None,
    ) -> None:
        self.config = config
        self.buffer = buffer
        self.collective = collective
        self.device = buffer.device if device is None else device
        self.result: dict[str, Any] | None = None
        self._tuner: _Tuner | None = None

    @property
    def pending(self) -> bool:
        """True while the bucket sizes are still being measured (the same on every rank)."""
        return self.config.autotune_buckets and self.result is None

    def restart(self) -> None:
        """Drop the measurements so far: their plans were cut for a layout now replaced."""
        self._tuner = None

    def observe(self, backward_s: float, t: int, step: int) -> None:
        """Measure the bucket plans of :mod:`syncline.dp.tuning` in turn; then keep the best.

        Called at the end of every synchronised backward (``t`` of them before this one since
        construction; ``step`` names it in messages) with the time from the first ready
        gradient to the end of communication: the only part of a step that bucket sizes
        change (no collective is in flight before the first gradient is ready). Two phases,
        as successive halving: every candidate for ``tune_rounds`` rounds, then the ones
        within ``tune_keep_margin`` of the best for ``tune_final_rounds`` more.
        """
        if self._tuner is None:
            self._tuner = self._make_tuner(start_step=t + 2)
            if self._tuner is None:  # a single candidate: nothing to measure
                self.result = {"chosen": "default", "candidates": [], "decided_at": t}
            return
        tuner = self._tuner
        pos = tuner.schedule.candidate_at(t)
        if pos is not None:
            tuner.samples[tuner.racing[pos]].append(backward_s)
        if t + 1 == tuner.schedule.end_step:
            combined = self._gather_times(tuner, step)
            keep = survivors(combined, tuner.racing, self.config.tune_keep_margin)
            if tuner.screening and len(keep) > 1:
                tuner.screening = False
                tuner.racing = keep
                tuner.schedule = TuningSchedule(
                    len(keep),
                    self.config.tune_steps_per_trial,
                    self.config.tune_final_rounds,
                    t + 1,
                )
            else:
                self._decide(tuner, combined, keep, t)
                return
        nxt = tuner.schedule.candidate_at(t + 1)
        if nxt is not None and tuner.racing[nxt] != tuner.active:
            tuner.active = tuner.racing[nxt]
            self.buffer.cut(tuner.plans[tuner.active])

    def _make_tuner(self, start_step: int) -> _Tuner | None:
        cfg, buf = self.config, self.buffer
        if buf.nbytes == 0:  # only sparse gradients: no bucket to size
            return None
        cands, plans, seen = [], [], set()
        for c in bucket_candidates(
            buf.nbytes,
            default_first=buf.caps[0],
            default_cap=buf.caps[1],
            min_bytes=max(1, int(cfg.tune_min_bucket_mb * 2**20)),
        ):
            plan = buf.plan_for(buf.plan.order, c.first_cap_bytes, c.cap_bytes)
            cuts = tuple((b.flat, b.end) for b in plan.buckets)
            if cuts not in seen:  # caps that cut this model the same way are one candidate
                seen.add(cuts)
                cands.append(c)
                plans.append(plan)
        if len(cands) < 2:
            return None
        schedule = TuningSchedule(len(cands), cfg.tune_steps_per_trial, cfg.tune_rounds, start_step)
        return _Tuner(cands, plans, schedule, racing=list(range(len(cands))))

    def _gather_times(self, tuner: _Tuner, step: int) -> list[list[float]]:
        """Every rank's times so far, combined per step (the same on every rank).

        Twice per tuning (after the screening and at the end), never once it is decided:
        the times are read back on the host, where the choice is made.
        """
        lengths = [len(s) for s in tuner.samples]  # the same on every rank: same schedule
        local = [x for s in tuner.samples for x in s]
        mine = torch.tensor(local, dtype=torch.float64, device=self.device)
        pending, gathered = self.collective.allgather(
            mine, f"bucket tuning measurements at step {step}"
        )
        pending.wait()
        per_rank = []
        for g in gathered:
            flat, rows, at = host_list(g, meta=local), [], 0
            for n in lengths:
                rows.append(flat[at : at + n])
                at += n
            per_rank.append(rows)
        return min_over_ranks(per_rank)

    def _decide(
        self, tuner: _Tuner, combined: list[list[float]], among: list[int], step: int
    ) -> None:
        """Adopt the fastest plan of ``among`` (the default unless clearly beaten)."""
        best = choose(combined, among=among)
        chosen = tuner.candidates[best]
        # kept if the layout changes
        self.buffer.caps = (chosen.first_cap_bytes, chosen.cap_bytes)
        self.buffer.cut(tuner.plans[best])
        self.result = {
            "chosen": chosen.label,
            "buckets": len(tuner.plans[best].buckets),
            "decided_at": step,
            "candidates": [
                {
                    "label": c.label,
                    "first_cap_bytes": c.first_cap_bytes,
                    "cap_bytes": c.cap_bytes,
                    "buckets": len(p.buckets),
                    "steps": len(s),
                    "median_backward_ms": 1e3 * statistics.median(s) if s else None,
                    "final": k in among,
                }
                for k, (c, p, s) in enumerate(
                    zip(tuner.candidates, tuner.plans, combined, strict=True)
                )
            ],
        }
        self._tuner = None
