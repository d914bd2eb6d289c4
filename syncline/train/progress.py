"""A one-line progress bar for rank 0: redrawn in place on a terminal, plain lines in logs."""

from __future__ import annotations

import sys
from typing import TextIO


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


class Progress:
    def __init__(self, total: int, stream: TextIO | None = None, width: int = 24) -> None:
        self.total = total
        self.stream = stream or sys.stdout
        self.width = width
        self.tty = self.stream.isatty()

    def line(
        self, step: int, loss: float, samples_s: float, tokens_s: float, wire: float | None
    ) -> str:
        """The progress text; ``wire`` (bytes allreduced per step) is left out when ``None``
        (a pipeline without data-parallel replicas reduces nothing)."""
        done = (step + 1) / self.total
        filled = int(done * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        return (
            f"step {step + 1:>5}/{self.total} [{bar}] loss {loss:7.4f} | "
            f"{samples_s:8.1f} samples/s | {tokens_s:9.0f} tokens/s"
            + ("" if wire is None else f" | {human_bytes(wire)}/step")
        )

    def update(
        self, step: int, loss: float, samples_s: float, tokens_s: float, wire: float | None
    ) -> None:
        text = self.line(step, loss, samples_s, tokens_s, wire)
        if self.tty:
            self.stream.write("\r" + text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def validation(self, step: int, metrics: dict[str, float]) -> None:
        """One plain line with the validation figures of ``step`` (kept in the scroll-back
        even on a terminal, where the progress line is redrawn)."""
        ppl = metrics.get("val_ppl")
        text = f"step {step + 1:>5}/{self.total} validation loss {metrics['val_loss']:.4f}" + (
            "" if ppl is None else f" | perplexity {ppl:.2f}"
        )
        self.stream.write(("\n" + text + "\n") if self.tty else text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
