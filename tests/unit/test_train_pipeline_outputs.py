"""The pipeline run's trace and Gantt chart from plain timelines (no processes needed)."""

from __future__ import annotations

import json

from syncline.schedule import (
    ActionKind,
    Event,
    add_communication,
    one_f_one_b,
    parse_action,
    simulate,
)
from syncline.train.pipeline_trainer import merge_timelines, write_trace
from syncline.train.plots import plot_schedule

PNG = b"\x89PNG\r\n\x1a\n"


def _events(rank: int, *spans: tuple[str, float, float]) -> list[Event]:
    return [Event(rank, parse_action(a), start, end) for a, start, end in spans]


def test_merge_on_a_shared_clock_keeps_the_offset_between_ranks() -> None:
    per_rank = [
        _events(0, ("0F0", 100.0, 100.5), ("0SEND_F0", 100.5, 100.6)),
        _events(1, ("1RECV_F0", 100.2, 100.6), ("1F0", 100.6, 101.0)),
    ]
    shared = merge_timelines("1f1b", per_rank, shared_clock=True)
    assert [round(e.start, 6) for e in shared.events[0]] == [0.0, 0.5]
    assert [round(e.start, 6) for e in shared.events[1]] == [0.2, 0.6]
    own = merge_timelines("1f1b", per_rank, shared_clock=False)
    assert own.events[1][0].start == 0.0 and round(own.events[1][1].start, 6) == 0.4


def test_trace_json_names_each_rank_and_holds_every_action(tmp_path) -> None:
    timeline = simulate(add_communication(one_f_one_b(2, 2)), t_f=0.001, t_b=0.002)
    path = write_trace(timeline, tmp_path / "trace.json", {0: [0], 1: [1]})
    trace = json.loads(path.read_text())
    names = [e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"]
    assert names == ["rank 0: stage 0", "rank 1: stage 1"]
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == sum(len(evs) for evs in timeline.events.values())
    first = min(spans, key=lambda e: e["ts"])
    assert first["name"] == "0F0" and first["dur"] == 1000.0  # microseconds


def test_schedule_png_of_a_recomputing_schedule_and_of_nothing(tmp_path) -> None:
    timeline = simulate(add_communication(one_f_one_b(3, 4, recompute=True)), t_comm=0.1)
    assert any(
        e.action.kind is ActionKind.RECOMPUTE for evs in timeline.events.values() for e in evs
    )
    path = plot_schedule(timeline, tmp_path / "schedule.png", "1f1b + recompute")
    assert path.read_bytes()[:8] == PNG
    empty = merge_timelines("1f1b", [[], []], shared_clock=True)
    assert plot_schedule(empty, tmp_path / "empty.png", "empty").read_bytes()[:8] == PNG
