"""PURE: ``CheckpointConfig``, when a run checkpoints, what it keeps and how it continues.

A part of :class:`syncline.train.config.TrainConfig` (``cfg.checkpoint``), and from it of the
``syncline train`` command line, each setting documented once. The checkpoints themselves
are written by :mod:`syncline.train.snapshots` (periodic, sharded) and
:mod:`syncline.train.checkpoint` (the final one); both load torch, so the settings live in
this module of their own, which the pure config imports.
"""

from __future__ import annotations

from dataclasses import dataclass

from syncline.errors import ConfigError
from syncline.fields import check_int, option

__all__ = ["DEFAULT_CHECKPOINT_EVERY", "GROUP", "ON_ERROR", "CheckpointConfig"]

#: the ``--help`` section of these settings
GROUP = "checkpoints and failures"
#: ``checkpoint_every`` when none is given
DEFAULT_CHECKPOINT_EVERY = 100
#: ``on_checkpoint_error``: end the run, or go on without that checkpoint
ON_ERROR = ("stop", "skip")


@dataclass(frozen=True)
class CheckpointConfig:
    """Periodic checkpoints, resuming from them, and restarts after a failure."""

    checkpoint_every: int | None = option(None, group=GROUP, metavar="N", default_text="100")
    """Write a complete sharded checkpoint (every rank its part, in parallel, published
    atomically) under RUN_DIR/checkpoints every N steps and after the last step; 0: only
    the final checkpoint.pt.
    2BW flushes at these steps (the batch after one starts on the newest weights, as the
    first batch does), so the checkpoint holds one weight version and nothing in flight."""
    keep_checkpoints: int = option(2, group=GROUP, metavar="K")
    """How many of the newest periodic checkpoints to keep."""
    resume: str | None = option(None, group=GROUP, metavar="RUN_DIR")
    """Continue the run in RUN_DIR from its newest complete checkpoint, with its own
    config.json; only ``steps`` (to extend the run) and launch/output settings may be given
    again. The continuation is bit-identical to an uninterrupted run."""
    on_checkpoint_error: str = option("stop", group=GROUP, choices=lambda: ON_ERROR)
    """What a periodic checkpoint that cannot be written (a full disk, an I/O error) does:
    ``stop`` ends the run with one line naming the path and the free space; ``skip`` warns in
    that line and goes on, trying again at the next checkpoint step. Either way the
    checkpoints before it stay intact and nothing partial is published."""
    max_restarts: int = option(0, group=GROUP, metavar="K")
    """Let torchrun restart every worker up to K times after a failure; restarted workers
    resume from the newest checkpoint by themselves."""

    def __post_init__(self) -> None:
        check_int("keep_checkpoints", self.keep_checkpoints)
        if self.checkpoint_every is None:
            object.__setattr__(self, "checkpoint_every", DEFAULT_CHECKPOINT_EVERY)
        check_int("checkpoint_every", self.checkpoint_every, low=0)
        check_int("max_restarts", self.max_restarts, low=0)
        if self.on_checkpoint_error not in ON_ERROR:
            raise ConfigError(
                f"on_checkpoint_error={self.on_checkpoint_error!r} is not known; valid: "
                f"{', '.join(ON_ERROR)}"
            )

    def next_due(self, done: int, steps: int) -> int | None:
        """The first step count after ``done`` at which a checkpoint is due, or None.

        Example:
            >>> CheckpointConfig(checkpoint_every=4).next_due(4, 9)
            8
        """
        return next((d for d in range(done + 1, steps + 1) if self.due(d, steps)), None)

    def due(self, done: int, steps: int) -> bool:
        """Whether a checkpoint is written once ``done`` of ``steps`` steps are done: every
        ``checkpoint_every`` steps and after the last one, so that ``--resume RUN_DIR --steps
        N`` extends a finished run from its end instead of replaying its last steps.

        Example:
            >>> [d for d in range(1, 10) if CheckpointConfig(checkpoint_every=4).due(d, 9)]
            [4, 8, 9]
        """
        every = self.checkpoint_every or 0
        return every > 0 and (done % every == 0 or done == steps)
