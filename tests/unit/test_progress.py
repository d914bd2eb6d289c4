"""Rank 0's progress line: the text as pure functions, and how it is written to a terminal
(redrawn in place, cut to the width) and to a log (plain lines)."""

from __future__ import annotations

import io
import os

import pytest

from syncline.train.progress import CLEAR_TO_EOL, Progress, eta_text, fit, progress_text


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(None, "?"), (float("nan"), "?"), (-1.0, "?"), (0.4, "0:00"), (59.6, "1:00"),
     (65, "1:05"), (3600, "1:00:00"), (3725.2, "1:02:05")],
)  # fmt: skip
def test_eta_text(seconds: float | None, text: str) -> None:
    assert eta_text(seconds) == text


def test_plain_line_keeps_todays_columns_and_adds_the_eta() -> None:
    text = progress_text(9, 40, 2.5, 100.0, 6400.0, 2048, 75.0, bar_width=8)
    assert text == (
        "step    10/40 [##......] loss  2.5000 |    100.0 samples/s |      6400 tokens/s"
        " | 2.00 KiB/step | ETA 1:15"
    )
    without_wire = progress_text(39, 40, 2.5, 100.0, 6400.0, None, None, bar_width=8)
    assert "/step" not in without_wire and "[########]" in without_wire
    assert without_wire.endswith("ETA ?")


def test_compact_line_puts_the_eta_where_a_cut_keeps_it() -> None:
    text = progress_text(9, 40, 2.5, 100.0, 6400.0, 2048, 75.0, bar_width=8, compact=True)
    assert text == (
        "step 10/40 [##......] 25% ETA 1:15 | loss 2.5000 | 100.0 samples/s | 6400 tokens/s"
        " | 2.00 KiB/step"
    )
    assert fit(text, 40) == "step 10/40 [##......] 25% ETA 1:15 | l~"
    assert len(fit(text, 40)) == 39 and fit(text, 200) == text and fit("abc", 1) == "~"


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_log_mode_writes_plain_lines_with_an_eta_from_the_steps_so_far() -> None:
    out, clock = io.StringIO(), _Clock()
    progress = Progress(11, out, width=4, tty=False, clock=clock)
    progress.update(0, 3.0, 10.0, 640.0, None, step_s=0.5)  # before any rate: 10 x step_s
    clock.now += 8.0  # 4 steps in 8 s: 2 s per step from here on
    progress.update(4, 2.0, 10.0, 640.0, None)
    progress.validation(4, {"val_loss": 2.25, "val_ppl": 9.49})
    progress.note("checkpoint of step 5")
    progress.close()
    lines = out.getvalue().split("\n")
    assert lines[0].endswith("ETA 0:05") and lines[1].endswith("ETA 0:12")
    assert lines[2] == "step     5/11 validation loss 2.2500 | perplexity 9.49"
    assert lines[3:] == ["checkpoint of step 5", ""]
    assert "\r" not in out.getvalue() and CLEAR_TO_EOL not in out.getvalue()


def test_terminal_mode_redraws_one_line_and_keeps_notes_above_it(monkeypatch) -> None:
    monkeypatch.setattr("shutil.get_terminal_size", lambda fallback: os.terminal_size((50, 24)))
    out = io.StringIO()
    progress = Progress(10, out, width=4, tty=True, clock=_Clock())
    progress.update(0, 3.0, 10.0, 640.0, 1024, step_s=1.0)
    bar = "step 1/10 [....] 10% ETA 0:09 | loss 3.0000 | 10~"  # 49 columns
    assert out.getvalue() == "\r" + bar + CLEAR_TO_EOL
    progress.note("checkpoint")  # the bar is erased, the note printed, the bar drawn again
    assert out.getvalue().endswith("\r" + CLEAR_TO_EOL + "checkpoint\n" + bar)
    progress.update(9, 2.0, 10.0, 640.0, 1024)
    progress.close()
    assert out.getvalue().endswith(CLEAR_TO_EOL + "\n") and out.getvalue().count("\n") == 2
