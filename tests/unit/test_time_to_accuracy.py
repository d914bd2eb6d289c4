"""The time-to-accuracy benchmark's pure parts: engine specs, the target crossing, the ratios."""

from __future__ import annotations

import pytest

from benchmarks.time_to_accuracy.main import _summary, parse_engine
from benchmarks.time_to_accuracy.ranks import _crossing

S = {"powersgd_rank": 4, "density": 0.01, "lr": 0.02}


def test_engine_specs_override_settings_by_name_and_refuse_unknowns() -> None:
    name, s = parse_engine("powersgd@powersgd_rank=1", S)
    assert (name, s["powersgd_rank"], S["powersgd_rank"]) == ("powersgd", 1, 4)
    assert parse_engine("csc@density=0.1,lr=0.05", S)[1] == {**S, "density": 0.1, "lr": 0.05}
    with pytest.raises(SystemExit, match="unknown engine 'sgd'"):
        parse_engine("sgd", S)
    with pytest.raises(SystemExit, match=r"bad override 'rank=1'.*keys: powersgd_rank"):
        parse_engine("powersgd@rank=1", S)


def test_the_crossing_is_interpolated_between_the_evaluations_around_it() -> None:
    before = {"step": 10, "wall_s": 5.0, "heldout_loss": 3.0}
    at = {"step": 20, "wall_s": 9.0, "heldout_loss": 2.0}
    got = _crossing(before, at, 2.75)
    assert (got["step"], got["wall_s"], got["eval_step"]) == (12.5, 6.0, 20)
    assert _crossing(before, {**at, "heldout_loss": 3.5}, 3.5)["step"] == 20  # no drop: at


def _run(wall: float | None) -> dict:
    reached = None if wall is None else {"wall_s": wall, "step": 10 * wall}
    return {"reached": reached, "wall_s": wall or 99.0, "steps_run": 100}


def test_ratios_are_to_the_fastest_ddp_configuration_and_per_round() -> None:
    runs = {
        "ddp": [_run(10.0), _run(12.0), _run(11.0)],
        "ddp-fp16": [_run(6.0), _run(5.0), _run(7.0)],
        "csc": [_run(2.0), _run(3.0), _run(2.5)],
        "topk": [_run(4.0), _run(None), _run(4.0)],
    }
    out = _summary(runs, ["ddp", "ddp-fp16"])
    assert out["best_ddp_configuration"] == "ddp-fp16"
    csc = out["engines"]["csc"]
    assert csc["speedup_vs_best_ddp"] == pytest.approx(6.0 / 2.5)
    assert csc["speedup_vs_ddp"] == pytest.approx(11.0 / 2.5)
    assert csc["speedup_vs_best_ddp_per_round"] == pytest.approx([3.0, 5.0 / 3.0, 7.0 / 2.5])
    topk = out["engines"]["topk"]  # missed the target in one round: no median, no ratio
    assert (topk["reached_in_rounds"], topk["time_to_target_s_median"]) == (2, None)
    assert topk["speedup_vs_ddp"] is None
