"""The per-call slices of the schedules: literal tables, and exactly the generated 2BW order."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from syncline.errors import ConfigError
from syncline.schedule import ScheduleError, add_communication, one_f_one_b, two_bw
from syncline.schedule.plan import calls, check_cut
from syncline.schedule.registry import build_plan
from tests.zoo.fresh import run_python


def _row(plan, kinds, rank):
    return [" ".join(map(str, call[rank])) for call in calls(plan, kinds)]


def test_two_bw_slices_literal() -> None:
    plan = build_plan("2bw", 2, 2, 2)
    # rank 0 starts batch 1 (one forward, w_0 = 1) before the STEP of batch 0
    assert _row(plan, ["start", "steady", "drain"], 0) == [
        "0F0@v0b0 0SEND_F0@b0 0F1@v0b0 0SEND_F1@b0 0RECV_B0@b0 0B0@v0b0 "
        "0F0@v0b1 0SEND_F0@b1 0RECV_B1@b0 0B1@v0b0 0REDUCE@b0 0STEP@v1b0",
        "0F1@v0b1 0SEND_F1@b1 0RECV_B0@b1 0B0@v0b1 0F0@v1b2 0SEND_F0@b2 "
        "0RECV_B1@b1 0B1@v0b1 0REDUCE@b1 0STEP@v2b1",
        "0F1@v1b2 0SEND_F1@b2 0RECV_B0@b2 0B0@v1b2 0RECV_B1@b2 0B1@v1b2 0REDUCE@b2 0STEP@v3b2",
    ]
    # the last stage never looks ahead: each call is one whole batch
    assert _row(plan, ["start", "steady"], 1) == [
        "1RECV_F0@b0 1F0@v0b0 1B0@v0b0 1SEND_B0@b0 1RECV_F1@b0 1F1@v0b0 1B1@v0b0 "
        "1SEND_B1@b0 1REDUCE@b0 1STEP@v1b0",
        "1RECV_F0@b1 1F0@v0b1 1B0@v0b1 1SEND_B0@b1 1RECV_F1@b1 1F1@v0b1 1B1@v0b1 "
        "1SEND_B1@b1 1REDUCE@b1 1STEP@v2b1",
    ]


def test_flush_schedule_is_one_slice_relabelled_per_batch() -> None:
    plan = build_plan("1f1b", 2, 2, 2)
    assert not plan.overlapping
    assert plan.choose(True, True).kind == "single"
    assert _row(plan, ["single", "single"], 1) == [
        "1RECV_F0@b0 1F0@b0 1B0@b0 1SEND_B0@b0 1RECV_F1@b0 1F1@b0 1B1@b0 1SEND_B1@b0 "
        "1REDUCE@b0 1STEP@b0",
        "1RECV_F0@b1 1F0@b1 1B0@b1 1SEND_B0@b1 1RECV_F1@b1 1F1@b1 1B1@b1 1SEND_B1@b1 "
        "1REDUCE@b1 1STEP@b1",
    ]
    plain = add_communication(one_f_one_b(2, 2)).actions[0]
    assert [str(a).split("@")[0] for a in calls(plan, ["single"])[0][0]] == list(map(str, plain))


def test_choose_table() -> None:
    plan = build_plan("2bw", 2, 2, 2)
    table = {(False, True): "start", (True, True): "steady", (True, False): "drain"}
    table[(False, False)] = "single"
    for (in_flight, has_next), kind in table.items():
        assert plan.choose(in_flight, has_next).kind == kind


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(0, 4), st.integers(0, 3), st.booleans())
def test_two_bw_calls_are_the_generated_schedule(d: int, extra: int, steady: int, rc: bool) -> None:
    m = d + extra
    plan = build_plan("2bw", d, d, m, recompute=rc)
    kinds = ["start", *["steady"] * steady, "drain"]
    want = add_communication(two_bw(d, m, len(kinds), recompute=rc))
    for rank in range(d):
        got = [a for call in calls(plan, kinds) for a in call[rank]]
        assert got == list(want.actions[rank])
    single = add_communication(two_bw(d, m, 1, recompute=rc))
    assert calls(plan, ["single"])[0] == {r: list(a) for r, a in single.actions.items()}
    # runs may follow each other (after a flush) without a message crossing back in time
    check_cut(plan, [*kinds, "single", "start", "drain"])


def test_check_cut_catches_a_receive_before_its_send() -> None:
    plan = build_plan("2bw", 3, 3, 3)
    with pytest.raises(ScheduleError, match="has its send in call"):
        check_cut(plan, ["start", "drain", "steady"])  # steady without its start


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("pipedream", 2, 2, 2), "schedule='pipedream' is unknown"),
        (("1f1b", 2, 3, 2), "num_stages=3 must equal the process group's size 2"),
        (("2bw", 3, 3, 2), "num_microbatches=2 must be >= num_stages=3"),
        (("interleaved", 2, 2, 2), "multiple >= 2 of the 2 ranks"),
        (("interleaved", 2, 5, 2), "multiple >= 2 of the 2 ranks"),
        (("interleaved", 2, 4, 3), "must be a multiple of num_ranks=2"),
        (("interleaved", 1, 2, 2), "group of 1 rank: adjacent stages would run on the same"),
    ],
)
def test_build_plan_rejects(args: tuple, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        build_plan(*args)


def test_interleaved_ranks_hold_strided_stages() -> None:
    plan = build_plan("interleaved", 2, 4, 2)
    assert plan.stages_of(0) == [0, 2] and plan.stages_of(1) == [1, 3]


def test_plan_does_not_import_torch() -> None:
    code = "import sys, syncline.schedule.plan; assert 'torch' not in sys.modules"
    run_python(code)
