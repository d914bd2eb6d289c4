"""The grid, the costed simulator (bubble closed forms), and the Chrome trace export."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from syncline.schedule import (
    Action,
    ActionKind,
    Event,
    Schedule,
    ScheduleError,
    Timeline,
    add_communication,
    bubble_fraction,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    render_grid,
    simulate,
    to_chrome_trace,
    two_bw,
)

stages = st.integers(1, 6)
microbatches = st.integers(1, 12)


def _idle(timeline: Timeline) -> Fraction:
    # Costs are small integers, so these float sums are exact.
    return Fraction(timeline.idle_time) / Fraction(timeline.total_stage_time)


def test_grid_gpipe_2_2() -> None:
    assert render_grid(gpipe(2, 2)) == "\n".join(
        [
            "gpipe: 2 stages on 2 ranks, m=2 micro-batches per batch; one tick per action",
            "tick   | 0       1       2       3       4       5       6       7",
            "rank 0 | 0F0     0F1     .       .       0B0     0B1     0REDUCE 0STEP",
            "rank 1 | .       1F0     1F1     1B0     1B1     1REDUCE 1STEP   .",
        ]
    )


def test_grid_marks_and_shows_the_stall() -> None:
    rows = {0: "0F0 0RECV_B0 0SEND_F0 0B0", 1: "1RECV_F0 1F0 1B0 1SEND_B0"}
    grid = render_grid(Schedule.from_strings("x", 2, 1, rows), mark=[(0, 1)])
    lines = grid.splitlines()
    assert lines[2] == "rank 0 | 0F0        [0RECV_B0] 0SEND_F0   0B0        ."
    assert lines[3] == "rank 1 | .          1RECV_F0   1F0        1B0        1SEND_B0"
    assert lines[4] == "stalled at tick 1: later cells of ranks [0, 1] never ran"


@settings(max_examples=60, deadline=None)
@given(stages, microbatches, st.sampled_from([1.0, 2.0, 3.0]), st.booleans())
def test_flush_bubble_closed_form(d: int, m: int, t_b: float, comm: bool) -> None:
    # (d-1)/(m+d-1): exact for equal costs (the requirement), and for integer t_b/t_f too.
    for schedule in (gpipe(d, m), one_f_one_b(d, m)):
        schedule = add_communication(schedule) if comm else schedule
        timeline = simulate(schedule, t_f=1.0, t_b=t_b)
        assert _idle(timeline) == Fraction(d - 1, m + d - 1)
        assert timeline.makespan == (m + d - 1) * (1.0 + t_b)
        assert bubble_fraction(timeline) == pytest.approx((d - 1) / (m + d - 1), abs=1e-12)


@settings(max_examples=40, deadline=None)
@given(stages, microbatches, st.integers(2, 3))
def test_interleaved_bubble_shrinks_with_chunks(d: int, m: int, chunks: int) -> None:
    m = max(d, m - m % d)
    timeline = simulate(interleaved_1f1b(d, m, chunks), t_f=1.0, t_b=1.0)
    assert _idle(timeline) == Fraction(d - 1, chunks * m + d - 1)


@settings(max_examples=40, deadline=None)
@given(stages, microbatches, st.integers(1, 3))
def test_two_bw_has_one_fill_and_drain_for_all_batches(d: int, m: int, num_batches: int) -> None:
    m = max(m, d)
    timeline = simulate(two_bw(d, m, num_batches), t_f=1.0, t_b=1.0)
    assert _idle(timeline) == Fraction(d - 1, num_batches * m + d - 1)


def test_costs_of_recompute_reduce_step_and_comm() -> None:
    timeline = simulate(gpipe(1, 2, recompute=True), t_f=1.0, t_b=2.0, t_reduce=0.5, t_step=0.25)
    assert timeline.makespan == 2 * 1.0 + 2 * (1.0 + 2.0) + 0.5 + 0.25
    assert bubble_fraction(timeline) == 0.5 / 8.75  # the REDUCE waits on the network
    # F0, message (0.5), F0, B0, message (0.5), B0.
    timeline = simulate(add_communication(gpipe(2, 1)), t_f=1.0, t_b=2.0, t_comm=0.5)
    assert timeline.makespan == 1.0 + 0.5 + 1.0 + 2.0 + 0.5 + 2.0
    recv = timeline.events[1][0]
    assert (str(recv.action), recv.start, recv.end) == ("1RECV_F0", 1.5, 1.5)


def test_simulate_reports_a_deadlock() -> None:
    rows = {0: "0F0 0RECV_B0 0SEND_F0 0B0", 1: "1RECV_F0 1F0 1B0 1SEND_B0"}
    with pytest.raises(ScheduleError, match="deadlocks") as info:
        simulate(Schedule.from_strings("x", 2, 1, rows))
    assert "[0RECV_B0]" in str(info.value)


def test_chrome_trace() -> None:
    schedule = add_communication(one_f_one_b(3, 4))
    trace = to_chrome_trace(simulate(schedule), us_per_unit=10.0)
    events = trace["traceEvents"]
    assert isinstance(events, list)
    assert len(events) == sum(len(acts) for acts in schedule.actions.values())
    assert {e["ph"] for e in events} == {"X"}
    assert {e["pid"] for e in events} == {0}
    assert {e["tid"] for e in events} == {0, 1, 2}
    first_backward = next(e for e in events if e["name"] == "2B0")
    # 0F0 [0, 1], 1F0 [1, 2], 2F0 [2, 3], then 2B0 [3, 5] in units of 10 us.
    expected = (30.0, 20.0, ActionKind.BACKWARD.name)
    assert (first_backward["ts"], first_backward["dur"], first_backward["cat"]) == expected
    json.dumps(trace)  # serialisable as is


@settings(max_examples=30, deadline=None)
@given(stages, microbatches, st.booleans())
def test_every_stage_idles_the_bubble_formula(d: int, m: int, comm: bool) -> None:
    """Per stage (not only on average): with t_f == t_b each of 1F1B's ranks works
    m * (t_f + t_b) of a makespan of (m + d - 1) * (t_f + t_b)."""
    schedule = one_f_one_b(d, m)
    timeline = simulate(add_communication(schedule) if comm else schedule, t_f=1.0, t_b=1.0)
    for rank, idle in timeline.idle_fractions().items():
        assert idle == pytest.approx((d - 1) / (m + d - 1), abs=1e-12), rank


def test_time_waiting_in_a_receive_is_idle() -> None:
    """A measured run blocks inside RECV (and REDUCE) until the peer's message is in: that
    time is idle, as if the rank had waited before the action."""
    f, b = Action(0, ActionKind.FORWARD, 0), Action(0, ActionKind.BACKWARD, 0)
    recv = Action(0, ActionKind.RECV_B, 0)
    events = (Event(0, f, 0.0, 1.0), Event(0, recv, 1.0, 3.0), Event(0, b, 3.0, 4.0))
    timeline = Timeline("measured", {0: events})
    assert timeline.idle_fractions() == {0: 0.5}
    assert bubble_fraction(timeline) == 0.5
