"""Schedule generators and passes against literal tables, plus their structural properties."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from syncline.errors import ConfigError
from syncline.schedule import (
    ActionKind,
    Schedule,
    ScheduleError,
    add_communication,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    two_bw,
)

K = ActionKind
stages = st.integers(1, 6)
microbatches = st.integers(1, 12)


def test_gpipe_2_3() -> None:
    assert gpipe(2, 3).to_strings() == {
        0: "0F0 0F1 0F2 0B0 0B1 0B2 0REDUCE 0STEP",
        1: "1F0 1F1 1F2 1B0 1B1 1B2 1REDUCE 1STEP",
    }


def test_one_f_one_b_3_4() -> None:
    assert one_f_one_b(3, 4).to_strings() == {
        0: "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3 0REDUCE 0STEP",
        1: "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3 1REDUCE 1STEP",
        2: "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3 2REDUCE 2STEP",
    }


def test_one_f_one_b_warmup_is_capped_by_m() -> None:
    # Stage 0 of 4 would warm up with 3 forwards; with m=2 it can only run 2.
    assert one_f_one_b(4, 2).to_strings()[0] == "0F0 0F1 0B0 0B1 0REDUCE 0STEP"


def test_two_bw_2_2_2() -> None:
    assert two_bw(2, 2, 2).to_strings() == {
        0: "0F0@v0b0 0F1@v0b0 0B0@v0b0 0F0@v0b1 0B1@v0b0 0REDUCE@b0 0STEP@v1b0 "
        "0F1@v0b1 0B0@v0b1 0B1@v0b1 0REDUCE@b1 0STEP@v2b1",
        1: "1F0@v0b0 1B0@v0b0 1F1@v0b0 1B1@v0b0 1REDUCE@b0 1STEP@v1b0 "
        "1F0@v0b1 1B0@v0b1 1F1@v0b1 1B1@v0b1 1REDUCE@b1 1STEP@v2b1",
    }


def test_two_bw_third_batch_uses_the_first_new_version() -> None:
    # Batch 2 uses v1 (made after batch 0). On stage 0 (w_0 = 1) its first forward runs
    # before batch 1's last backward, and so before v2 exists.
    assert two_bw(2, 2, 3).to_strings()[0] == (
        "0F0@v0b0 0F1@v0b0 0B0@v0b0 0F0@v0b1 0B1@v0b0 0REDUCE@b0 0STEP@v1b0 "
        "0F1@v0b1 0B0@v0b1 0F0@v1b2 0B1@v0b1 0REDUCE@b1 0STEP@v2b1 "
        "0F1@v1b2 0B0@v1b2 0B1@v1b2 0REDUCE@b2 0STEP@v3b2"
    )


def test_interleaved_2_4_2() -> None:
    schedule = interleaved_1f1b(2, 4, 2)
    assert (schedule.num_stages, schedule.num_ranks, schedule.stages_per_rank) == (4, 2, 2)
    assert schedule.to_strings() == {
        0: "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3 "
        "0REDUCE 0STEP 2REDUCE 2STEP",
        1: "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3 "
        "1REDUCE 1STEP 3REDUCE 3STEP",
    }


def test_interleaved_with_one_chunk_is_1f1b() -> None:
    assert interleaved_1f1b(3, 6, 1).to_strings() == one_f_one_b(3, 6).to_strings()


def test_recompute_goes_right_before_each_backward() -> None:
    assert gpipe(1, 2, recompute=True).to_strings() == {0: "0F0 0F1 0R0 0B0 0R1 0B1 0REDUCE 0STEP"}
    row = two_bw(2, 2, 2, recompute=True).to_strings()[0]
    assert row.startswith("0F0@v0b0 0F1@v0b0 0R0@v0b0 0B0@v0b0 0F0@v0b1 0R1@v0b0 0B1@v0b0")


def test_add_communication_gpipe_2_2() -> None:
    assert add_communication(gpipe(2, 2, recompute=True)).to_strings() == {
        0: "0F0 0SEND_F0 0F1 0SEND_F1 0R0 0RECV_B0 0B0 0R1 0RECV_B1 0B1 0REDUCE 0STEP",
        1: "1RECV_F0 1F0 1RECV_F1 1F1 1R0 1B0 1SEND_B0 1R1 1B1 1SEND_B1 1REDUCE 1STEP",
    }


def test_add_communication_keeps_the_batch_not_the_version() -> None:
    row = add_communication(two_bw(2, 2, 2)).to_strings()[1].split()
    assert row[:3] == ["1RECV_F0@b0", "1F0@v0b0", "1B0@v0b0"]
    assert "1SEND_B0@b1" in row


def test_add_communication_twice_is_an_error() -> None:
    with pytest.raises(ScheduleError, match="already has communication"):
        add_communication(add_communication(gpipe(2, 1)))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: gpipe(0, 1), "num_stages=0 is invalid; valid: an integer >= 1"),
        (lambda: gpipe(2, 0), "num_microbatches=0 is invalid; valid: an integer >= 1"),
        (lambda: one_f_one_b(2.0, 2), "num_stages=2.0 is invalid; valid: an integer"),
        (lambda: one_f_one_b(True, 2), "num_stages=True is invalid; valid: an integer"),
        (lambda: two_bw(4, 2, 1), "num_microbatches=2 must be >= num_stages=4 for 2bw"),
        (lambda: two_bw(2, 2, 0), "num_batches=0 is invalid; valid: an integer >= 1"),
        (lambda: interleaved_1f1b(4, 6, 2), "num_microbatches=6 must be a multiple of num_ranks=4"),
        (lambda: interleaved_1f1b(2, 4, 0), "chunks=0 is invalid; valid: an integer >= 1"),
    ],
)
def test_bad_inputs_raise_config_error(call: Callable[[], object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        call()


def _compute(schedule: Schedule) -> dict[int, list[str]]:
    return {
        r: [str(a) for a in acts if a.kind not in _COMM] for r, acts in schedule.actions.items()
    }


_COMM = {K.SEND_F, K.RECV_F, K.SEND_B, K.RECV_B}


@settings(max_examples=50, deadline=None)
@given(stages, microbatches)
def test_1f1b_warmup_and_in_flight(d: int, m: int) -> None:
    for r, acts in one_f_one_b(d, m).actions.items():
        kinds = [a.kind for a in acts]
        assert kinds.index(K.BACKWARD) == min(d - r - 1, m) + (1 if d - r - 1 < m else 0)
        in_flight, peak = 0, 0
        for kind in kinds:
            in_flight += {K.FORWARD: 1, K.BACKWARD: -1}.get(kind, 0)
            peak = max(peak, in_flight)
        assert peak == min(d - r, m)
        assert kinds[-2:] == [K.REDUCE, K.STEP]


@settings(max_examples=50, deadline=None)
@given(stages, microbatches, st.integers(1, 3))
def test_two_bw_versions_follow_the_batch(d: int, m: int, num_batches: int) -> None:
    m = max(m, d)
    for acts in two_bw(d, m, num_batches).actions.values():
        for a in acts:
            assert a.batch is not None
            if a.kind is K.STEP:
                assert a.version == a.batch + 1
            elif a.kind is not K.REDUCE:
                assert a.version == max(a.batch - 1, 0)
        assert sum(a.kind is K.STEP for a in acts) == num_batches


@settings(max_examples=50, deadline=None)
@given(stages, microbatches, st.booleans())
def test_add_communication_keeps_the_compute_order(d: int, m: int, recompute: bool) -> None:
    for schedule in (gpipe(d, m, recompute=recompute), one_f_one_b(d, m, recompute=recompute)):
        with_comm = add_communication(schedule)
        assert _compute(with_comm) == _compute(schedule)
        sends = sum(
            a.kind in (K.SEND_F, K.SEND_B) for acts in with_comm.actions.values() for a in acts
        )
        assert sends == 2 * m * (d - 1)
