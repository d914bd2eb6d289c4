"""PURE: ``GuardConfig``, what a run does when a step's loss or gradient is not finite or spikes.

A part of :class:`syncline.train.config.TrainConfig` (``cfg.guard``), and from it of the
``syncline train`` command line (``--on-nonfinite``, ``--skip-batches``, ``--spike-factor``,
...); the library's :class:`syncline.dp.guard.StepGuard` takes the same object. The guard
itself (detection on the device, agreement inside the gradient reduction) is
:mod:`syncline.dp.guard`; what the loop does with a verdict, :mod:`syncline.train.guarding`.
"""

from __future__ import annotations

from dataclasses import dataclass

from syncline.errors import ConfigError
from syncline.fields import check_float, check_int, option

__all__ = ["GROUP", "GUARD_ACTIONS", "GuardConfig"]

#: the ``--help`` section of these settings
GROUP = "non-finite values and loss spikes"
#: ``on_nonfinite``: ``off`` (no guard, no cost), or what an event does
GUARD_ACTIONS = ("off", "stop", "skip", "rollback")
#: what ``inject_nonfinite`` can inject
INJECTIONS = ("nan", "spike")


@dataclass(frozen=True)
class GuardConfig:
    """The guard against NaN/Inf and loss spikes: on or off, and what an event does."""

    on_nonfinite: str = option("off", group=GROUP, choices=lambda: GUARD_ACTIONS)
    """What a step whose loss or gradient holds a NaN or an Inf on any rank (or whose loss
    spikes, see ``spike_factor``) does: ``stop`` (end the run with one line naming the step,
    the ranks and the first non-finite parameter; no checkpoint after that step), ``skip``
    (drop that step's update; optimizer state untouched; counted), ``rollback`` (restore the
    newest checkpoint and skip ``skip_batches`` batches from the offending one on), or
    ``off`` (no guard). Detected on the device and agreed across ranks inside the gradient
    reduction the step already makes: no host read and no collective of its own."""
    skip_batches: int = option(1, group=GROUP, metavar="K")
    """``rollback``: batches of the data stream skipped, from the one that caused the
    event on (it included)."""
    spike_factor: float | None = option(None, group=GROUP, metavar="F", default_text="off")
    """A loss above F x the median of the last ``spike_window`` good losses (the ranks'
    mean loss, computed on the device) counts as an event, handled as ``on_nonfinite`` says;
    judged once the window is full. ``None``: non-finite values only."""
    spike_window: int = option(20, group=GROUP, metavar="N")
    """Good steps whose loss the spike test takes the median of."""
    inject_nonfinite: str | None = option(None, group=GROUP, metavar="RANK:STEP[:KIND]")
    """Testing aid: at STEP, RANK's gradient of its first parameter becomes NaN (KIND
    ``nan``, the default), or its loss x1000 (``spike``), to see the guard act."""

    def __post_init__(self) -> None:
        if self.on_nonfinite not in GUARD_ACTIONS:
            raise ConfigError(
                f"on_nonfinite={self.on_nonfinite!r} is unknown; valid: {', '.join(GUARD_ACTIONS)}"
            )
        check_int("skip_batches", self.skip_batches)
        check_int("spike_window", self.spike_window, low=3)
        if self.spike_factor is not None:
            check_float("spike_factor", self.spike_factor, above=1)
            if not self.on:
                raise ConfigError(
                    f"spike_factor={self.spike_factor} needs a guard; valid: on_nonfinite "
                    "stop, skip or rollback"
                )
        if self.inject_nonfinite is not None:
            self.injection()

    @property
    def on(self) -> bool:
        """Whether the guard runs."""
        return self.on_nonfinite != "off"

    def injection(self) -> tuple[int, int, str] | None:
        """``inject_nonfinite`` parsed as ``(rank, step, kind)``, or ``None``.

        Raises:
            ConfigError: not ``RANK:STEP[:KIND]``, or the guard is off.
        """
        if self.inject_nonfinite is None:
            return None
        parts = self.inject_nonfinite.split(":")
        try:
            if len(parts) not in (2, 3):
                raise ValueError
            rank, step = int(parts[0]), int(parts[1])
            kind = parts[2] if len(parts) == 3 else "nan"
            if kind not in INJECTIONS or rank < 0 or step < 0:
                raise ValueError
        except ValueError:
            raise ConfigError(
                f"inject_nonfinite={self.inject_nonfinite!r} must look like RANK:STEP[:KIND] "
                f"with KIND one of {', '.join(INJECTIONS)}, e.g. 1:5 or 0:7:spike"
            ) from None
        if not self.on:
            raise ConfigError(
                f"inject_nonfinite={self.inject_nonfinite!r} needs a guard; valid: "
                "on_nonfinite stop, skip or rollback"
            )
        return rank, step, kind
