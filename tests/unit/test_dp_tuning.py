"""Bucket tuning's pure parts: the candidates, the trial order, the choice."""

from __future__ import annotations

import doctest

import pytest

from syncline.dp import tuning
from syncline.dp.tuning import (
    MIB,
    TuningSchedule,
    bucket_candidates,
    choose,
    min_over_ranks,
    survivors,
)
from syncline.errors import ConfigError


def test_doctest_examples_hold() -> None:
    assert doctest.testmod(tuning, raise_on_error=False).failed == 0


def test_candidates_default_first_then_one_bucket_then_halves() -> None:
    total = 3_468_288  # the default GPT's gradient bytes
    cands = bucket_candidates(total, default_first=MIB, default_cap=25 * MIB, min_bytes=MIB // 8)
    assert (cands[0].first_cap_bytes, cands[0].cap_bytes) == (MIB, 25 * MIB)
    assert (cands[1].first_cap_bytes, cands[1].cap_bytes) == (total, total)
    caps = [c.cap_bytes for c in cands[2:]]
    assert caps == [total // 2, total // 4, total // 8, total // 16]
    assert all(c.first_cap_bytes == c.cap_bytes for c in cands[2:])
    assert min(caps) >= MIB // 8 > total // 32
    assert cands[2].label == "cap 1.65 MiB" and cands[-1].label == "cap 211.7 KiB"


def test_candidates_first_cap_never_above_the_cap() -> None:
    c = bucket_candidates(10 * MIB, default_first=4 * MIB, default_cap=2 * MIB, min_bytes=MIB)
    assert (c[0].first_cap_bytes, c[0].cap_bytes) == (2 * MIB, 2 * MIB)


@pytest.mark.parametrize(
    "kwargs, bad",
    [
        ({"total_bytes": 0}, "total_bytes=0"),
        ({"default_first": -1}, "default_first=-1"),
        ({"min_bytes": 0}, "min_bytes=0"),
    ],
)
def test_candidates_reject_non_positive_sizes(kwargs: dict, bad: str) -> None:
    args = {"default_first": 10, "default_cap": 50, "min_bytes": 10}
    args.update({k: v for k, v in kwargs.items() if k != "total_bytes"})
    with pytest.raises(ConfigError, match=bad):
        bucket_candidates(kwargs.get("total_bytes", 100), **args)


def test_schedule_runs_each_candidate_per_round_and_alternates_direction() -> None:
    s = TuningSchedule(candidates=3, steps_per_trial=1, rounds=3, start_step=5)
    assert s.end_step == 5 + 9
    seen = [s.candidate_at(t) for t in range(5, 14)]
    assert seen == [0, 1, 2, 2, 1, 0, 0, 1, 2]
    assert s.candidate_at(4) is None and s.candidate_at(14) is None
    # every candidate gets the same number of steps
    assert all(seen.count(k) == 3 for k in range(3))


@pytest.mark.parametrize(
    "kwargs, bad",
    [
        ({"candidates": 0}, "candidates=0"),
        ({"steps_per_trial": 0}, "steps_per_trial=0"),
        ({"rounds": 0}, "rounds=0"),
        ({"start_step": -1}, "start_step=-1"),
    ],
)
def test_schedule_rejects_bad_sizes(kwargs: dict, bad: str) -> None:
    args = {"candidates": 2, "steps_per_trial": 1, "rounds": 1, "start_step": 0, **kwargs}
    with pytest.raises(ConfigError, match=bad):
        TuningSchedule(**args)


def test_choose_takes_the_fastest_median() -> None:
    assert choose([[10.0, 10.2, 9.9], [9.0, 30.0, 9.1], [9.5, 9.4, 9.6]]) == 1


def test_choose_keeps_the_default_within_tolerance() -> None:
    assert choose([[10.0], [9.95]], tolerance=0.01) == 0
    assert choose([[10.0], [9.8]], tolerance=0.01) == 1


def test_choose_among_survivors_without_the_default() -> None:
    times = [[10.0], [9.0], [8.0, 9.5, 9.6]]
    assert choose(times, among=[1, 2]) == 1  # median 9.0 vs 9.5
    assert choose(times, among=[0, 2]) == 2  # 9.5 beats the default by more than 1 %


def test_survivors_keep_the_close_ones() -> None:
    times = [[10.0, 10.0], [9.0, 9.2], [9.5, 9.5], [12.0, 12.0]]
    assert survivors(times, [0, 1, 2, 3], margin=0.05) == [1, 2]
    assert survivors(times, [0, 1, 2, 3], margin=0.2) == [0, 1, 2]
    assert survivors(times, [3], margin=0.0) == [3]
    with pytest.raises(ConfigError, match="every candidate needs measurements"):
        survivors(times, [], margin=0.05)


def test_choose_needs_measurements() -> None:
    with pytest.raises(ConfigError, match="every candidate needs measurements"):
        choose([[1.0], []])


def test_engine_refuses_tuning_with_a_stateful_compressor_before_any_work() -> None:
    # raised before the constructor touches torch.distributed (no process group exists here)
    from torch import nn

    from syncline import DataParallel
    from syncline.dp.compressors import build_compressor

    with pytest.raises(ConfigError, match="autotune_buckets=True needs a stateless compressor"):
        DataParallel(
            nn.Linear(2, 2), autotune_buckets=True, compression=build_compressor("csc:0.01")
        )
    with pytest.raises(ConfigError, match="tune_rounds=0 is invalid; valid: an integer >= 1"):
        DataParallel(nn.Linear(2, 2), tune_rounds=0)


def test_min_over_ranks_takes_each_steps_shortest_window() -> None:
    per_rank = [
        [[1.0, 5.0], [2.0, 2.0]],  # rank 0: candidate 0's 2nd step waited for rank 1
        [[3.0, 1.5], [2.5, 1.0]],
    ]
    assert min_over_ranks(per_rank) == [[1.0, 1.5], [2.0, 1.0]]
    with pytest.raises(ConfigError, match="same candidates and samples"):
        min_over_ranks([[[1.0]], [[1.0, 2.0]]])
