"""Rank 0's progress: one line redrawn in place on a terminal, plain lines in logs.

The text is made by pure functions (:func:`progress_text`, :func:`fit`, :func:`eta_text`),
tested without a terminal; :class:`Progress` only decides how to write it. On a terminal
the line is redrawn with a carriage return and cut to the terminal's width (a wrapped line
could not be redrawn); everything that must stay in the scroll-back (validation figures,
checkpoints) is written as a line of its own above it. Piped to a file or a log collector,
each update is a plain line, as ``tail -f`` and ``grep`` expect. No tqdm: the line is four
numbers and a bar, and it must look the same in both modes.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable
from typing import TextIO

__all__ = ["Progress", "eta_text", "fit", "human_bytes", "progress_text"]

#: ANSI "erase to the end of the line": what a shorter redraw leaves of the longer one
CLEAR_TO_EOL = "\x1b[K"


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def eta_text(seconds: float | None) -> str:
    """``H:MM:SS`` (``M:SS`` under an hour), or ``?`` while unknown.

    Example:
        >>> eta_text(3725.2), eta_text(65), eta_text(None)
        ('1:02:05', '1:05', '?')
    """
    if seconds is None or seconds != seconds or seconds < 0:
        return "?"
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def progress_text(
    step: int,
    total: int,
    loss: float,
    samples_s: float,
    tokens_s: float,
    wire: float | None,
    eta_s: float | None,
    *,
    bar_width: int = 24,
    compact: bool = False,
) -> str:
    """The progress line after step ``step`` (0-based) of ``total``; ``wire`` (bytes
    allreduced per step) is left out when ``None`` (a pipeline reports its bytes in the
    summary). ``compact`` (the terminal's line): no padding, and the ETA next to the bar,
    where cutting the line to the terminal's width (:func:`fit`) does not lose it.

    Example:
        >>> text = progress_text(9, 40, 2.5, 100.0, 6400.0, 2048, 75.0, bar_width=8)
        >>> text[:37], text[-35:]
        ('step    10/40 [##......] loss  2.5000', 'tokens/s | 2.00 KiB/step | ETA 1:15')
        >>> progress_text(9, 40, 2.5, 100.0, 6400.0, None, 75.0, bar_width=8, compact=True)
        'step 10/40 [##......] 25% ETA 1:15 | loss 2.5000 | 100.0 samples/s | 6400 tokens/s'
    """
    done = (step + 1) / total
    filled = int(done * bar_width)
    bar = "#" * filled + "." * (bar_width - filled)
    wire_text = "" if wire is None else f" | {human_bytes(wire)}/step"
    if compact:
        return (
            f"step {step + 1}/{total} [{bar}] {done:.0%} ETA {eta_text(eta_s)} | "
            f"loss {loss:.4f} | {samples_s:.1f} samples/s | {tokens_s:.0f} tokens/s{wire_text}"
        )
    return (
        f"step {step + 1:>5}/{total} [{bar}] loss {loss:7.4f} | "
        f"{samples_s:8.1f} samples/s | {tokens_s:9.0f} tokens/s{wire_text}"
        f" | ETA {eta_text(eta_s)}"
    )


def fit(text: str, columns: int) -> str:
    """``text`` cut to fit ``columns - 1`` characters (the last column would wrap on some
    terminals), ending with ``~`` where it was cut.

    Example:
        >>> fit("step 1/3 loss 2.0", 10), fit("short", 10)
        ('step 1/3~', 'short')
    """
    room = max(columns - 1, 1)
    return text if len(text) <= room else text[: room - 1] + "~"


class Progress:
    """Writes :func:`progress_text` lines: redrawn in place on a terminal, else plain.

    Args:
        total: steps of the run.
        stream: where to write (default stdout).
        width: characters of the bar.
        tty: whether to redraw in place; default: whether ``stream`` is a terminal.
        clock: seconds, for the ETA (``time.perf_counter``; a test passes its own).
    """

    def __init__(
        self,
        total: int,
        stream: TextIO | None = None,
        width: int = 24,
        *,
        tty: bool | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.total = total
        self.stream = stream or sys.stdout
        self.width = width
        self.tty = self.stream.isatty() if tty is None else tty
        self._clock = clock
        self._first: tuple[int, float] | None = None  # (step, time) of the first update
        self._shown = ""  # the line on screen (terminal only), redrawn after notes

    def eta_s(self, step: int, step_s: float | None = None) -> float | None:
        """Seconds left after ``step``: the mean time per step since the first update
        (validation and checkpoints included, as they will recur), or ``step_s`` per step
        before there is one."""
        left = self.total - 1 - step
        now = self._clock()
        if self._first is None or step <= self._first[0]:
            return None if step_s is None else left * step_s
        first_step, first_time = self._first
        return left * (now - first_time) / (step - first_step)

    def update(
        self,
        step: int,
        loss: float,
        samples_s: float,
        tokens_s: float,
        wire: float | None,
        *,
        step_s: float | None = None,
    ) -> None:
        eta = self.eta_s(step, step_s)
        if self._first is None:
            self._first = (step, self._clock())
        text = progress_text(
            step, self.total, loss, samples_s, tokens_s, wire, eta, bar_width=self.width,
            compact=self.tty,
        )  # fmt: skip
        if self.tty:
            self._shown = fit(text, shutil.get_terminal_size((120, 24)).columns)
            self.stream.write("\r" + self._shown + CLEAR_TO_EOL)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def validation(self, step: int, metrics: dict[str, float]) -> None:
        """One line with the validation figures of ``step``, kept in the scroll-back."""
        ppl = metrics.get("val_ppl")
        self.note(
            f"step {step + 1:>5}/{self.total} validation loss {metrics['val_loss']:.4f}"
            + ("" if ppl is None else f" | perplexity {ppl:.2f}")
        )

    def note(self, text: str) -> None:
        """A line of its own; on a terminal written above the progress line, which is
        redrawn below it."""
        if self.tty:
            self.stream.write("\r" + CLEAR_TO_EOL + text + "\n" + self._shown)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self._shown:
            self.stream.write("\n")
            self.stream.flush()
            self._shown = ""
