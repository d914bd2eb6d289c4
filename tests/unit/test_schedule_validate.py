"""validate(): every generated schedule passes; each kind of broken schedule is caught."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from syncline.schedule import (
    ActionKind,
    Schedule,
    ScheduleError,
    add_communication,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    two_bw,
    validate,
)

K = ActionKind
stages = st.integers(1, 6)
microbatches = st.integers(1, 12)


def _assert_valid(schedule: Schedule) -> None:
    """validate() raises ScheduleError on any broken schedule, so returning is the pass."""
    validate(schedule)
    validate(add_communication(schedule))


@settings(max_examples=60, deadline=None)
@given(stages, microbatches, st.booleans())
def test_flush_schedules_validate(d: int, m: int, recompute: bool) -> None:
    _assert_valid(gpipe(d, m, recompute=recompute))
    _assert_valid(one_f_one_b(d, m, recompute=recompute))


@settings(max_examples=60, deadline=None)
@given(stages, microbatches, st.integers(1, 3), st.booleans())
def test_two_bw_validates(d: int, m: int, num_batches: int, recompute: bool) -> None:
    _assert_valid(two_bw(d, max(m, d), num_batches, recompute=recompute))


@settings(max_examples=60, deadline=None)
@given(stages, microbatches, st.integers(1, 3), st.booleans())
def test_interleaved_validates(d: int, m: int, chunks: int, recompute: bool) -> None:
    m = max(d, m - m % d)
    _assert_valid(interleaved_1f1b(d, m, chunks, recompute=recompute))


def _assert_rejected(rows: dict[int, str], m: int = 1, d: int = 2, match: str = "") -> str:
    """validate() must raise ScheduleError matching ``match``, with the grid in the text."""
    schedule = Schedule.from_strings("broken", d, m, rows)
    with pytest.raises(ScheduleError, match=match) as info:
        validate(schedule)
    message = str(info.value)
    assert "rank 0 | " in message  # the grid is part of the message
    return message


GPIPE_2_1 = {
    0: "0F0 0SEND_F0 0RECV_B0 0B0 0REDUCE 0STEP",
    1: "1RECV_F0 1F0 1B0 1SEND_B0 1REDUCE 1STEP",
}


def test_fixture_is_what_add_communication_makes() -> None:
    assert add_communication(gpipe(2, 1)).to_strings() == GPIPE_2_1


def test_swapped_send_and_recv_deadlock() -> None:
    rows = {**GPIPE_2_1, 0: "0F0 0RECV_B0 0SEND_F0 0B0 0REDUCE 0STEP"}
    message = _assert_rejected(rows, match="deadlock: rank 0 waits at 0RECV_B0 for 1SEND_B0")
    assert "[0RECV_B0]" in message
    assert "[1RECV_F0]" in message


def test_compute_only_deadlock() -> None:
    rows = {0: "0F0 0B0 0F1 0B1 0REDUCE 0STEP", 1: "1F1 1B1 1F0 1B0 1REDUCE 1STEP"}
    _assert_rejected(
        rows, m=2, match="deadlock: rank 0 waits at 0B0 for 1B0; rank 1 waits at 1F1 for 0F1"
    )


def test_send_before_its_forward() -> None:
    rows = {**GPIPE_2_1, 0: "0SEND_F0 0F0 0RECV_B0 0B0 0REDUCE 0STEP"}
    assert "[0SEND_F0]" in _assert_rejected(rows, match="0SEND_F0 needs 0F0 earlier on rank 0")


def test_forward_before_its_recv() -> None:
    rows = {**GPIPE_2_1, 1: "1F0 1RECV_F0 1B0 1SEND_B0 1REDUCE 1STEP"}
    _assert_rejected(rows, match="1F0 needs 1RECV_F0 earlier on rank 1")


def test_backward_before_forward() -> None:
    rows = {0: "0F0 0B0 0REDUCE 0STEP", 1: "1B0 1F0 1REDUCE 1STEP"}
    assert "[1B0]" in _assert_rejected(rows, match="1B0 needs 1F0 earlier on rank 1")


def test_recompute_after_backward() -> None:
    rows = {0: "0F0 0B0 0R0 0REDUCE 0STEP", 1: "1F0 1B0 1REDUCE 1STEP"}
    _assert_rejected(rows, match="0R0 comes after its backward")


def test_unmatched_send() -> None:
    rows = {**GPIPE_2_1, 1: "1RECV_F0 1F0 1B0 1REDUCE 1STEP"}
    _assert_rejected(rows, match="0RECV_B0 on rank 0 has no matching 1SEND_B0")


def test_send_off_the_end_of_the_pipeline() -> None:
    rows = {**GPIPE_2_1, 1: "1RECV_F0 1F0 1SEND_F0 1B0 1SEND_B0 1REDUCE 1STEP"}
    _assert_rejected(rows, match="1SEND_F0 on rank 1: stage 1 has no such neighbour")


def test_action_on_the_wrong_rank() -> None:
    rows = {0: "1F0 0B0 0REDUCE 0STEP", 1: "0F0 1B0 1REDUCE 1STEP"}
    _assert_rejected(rows, match="1F0 is on rank 0 but stage 1 runs on rank 1")


def test_microbatch_out_of_range() -> None:
    rows = {0: "0F0 0F1 0B0 0B1 0REDUCE 0STEP", 1: "1F0 1F1 1B0 1B1 1REDUCE 1STEP"}
    _assert_rejected(rows, m=1, match="0F1: micro-batch must be < 1")


def test_duplicate_action() -> None:
    rows = {0: "0F0 0F0 0B0 0REDUCE 0STEP", 1: "1F0 1B0 1REDUCE 1STEP"}
    _assert_rejected(rows, match="0F0 appears twice on rank 0")


def test_missing_microbatch() -> None:
    rows = {0: "0F0 0F1 0B0 0B1 0REDUCE 0STEP", 1: "1F0 1B0 1REDUCE 1STEP"}
    _assert_rejected(rows, m=2, match="1REDUCE after only 1 of 2 backwards")
    rows = {0: "0F0 0B0", 1: "1F0 1F1 1B0 1B1"}
    _assert_rejected(rows, m=2, match="incomplete: stage 0 never runs 0F1")


def test_step_before_the_last_backward() -> None:
    rows = {0: "0F0 0REDUCE 0B0 0STEP", 1: "1F0 1B0 1REDUCE 1STEP"}
    assert "[0REDUCE]" in _assert_rejected(rows, match="0REDUCE after only 0 of 1 backwards")


def _two_bw_rows(**edits: str) -> dict[int, str]:
    rows = two_bw(2, 2, 3).to_strings()
    for old, new in edits.items():
        rows = {r: row.replace(old, new) for r, row in rows.items()}
    return rows


def test_two_bw_version_mismatch() -> None:
    rows = _two_bw_rows(**{"0B0@v1b2": "0B0@v0b2"})
    message = _assert_rejected(rows, m=2, match="0B0@v0b2 uses version 0 but its forward used 1")
    assert "[0B0@v0b2]" in message


def test_two_bw_version_used_before_it_exists() -> None:
    rows = _two_bw_rows(**{"0F0@v1b2": "0F0@v2b2", "0B0@v1b2": "0B0@v2b2"})
    _assert_rejected(rows, m=2, match=r"0F0@v2b2 uses v2 before it exists \(latest v1\)")


def test_two_bw_batch_mixes_versions_across_stages() -> None:
    rows = _two_bw_rows(**{"1F0@v1b2": "1F0@v2b2", "1B0@v1b2": "1B0@v2b2"})
    _assert_rejected(rows, m=2, match="1F0@v2b2 and 0F0@v1b2 are in one batch but use different")


def test_two_bw_step_skips_a_version() -> None:
    rows = _two_bw_rows(**{"0STEP@v2b1": "0STEP@v3b1"})
    _assert_rejected(rows, m=2, match="0STEP@v3b1 should produce v2 after v1")


def test_three_versions_live() -> None:
    # Two-step-stale weights (PipeDream-style stashing) need a third version on stage 0.
    schedule = two_bw(2, 2, 4)
    rows = {
        r: [
            replace(a, version=max(a.batch - 2, 0))
            if a.kind is not K.STEP and a.batch is not None and a.version is not None
            else a
            for a in acts
        ]
        for r, acts in schedule.actions.items()
    }
    with pytest.raises(ScheduleError, match="stage 0 holds v0, v1, v2 at once; 2BW keeps 2"):
        validate(replace(schedule, actions=rows))
