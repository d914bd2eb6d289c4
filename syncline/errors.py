"""Domain exceptions: every error syncline raises on purpose is one of these."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is invalid; raised before any work starts.

    The message names the bad value and what would be valid, in one line, so that the
    command line can print it without a traceback.
    """


class CommError(RuntimeError):
    """A collective or point-to-point operation failed or did not finish."""


class CommTimeout(CommError):
    """A distributed wait ran past its timeout; the message names the rank and the step."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, truncated or does not match its recorded digest."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (no space left, an I/O error); the checkpoints
    published before it are intact. ``no_space``: the file system was full."""

    def __init__(self, message: str, *, no_space: bool = False) -> None:
        super().__init__(message)
        self.no_space = no_space
