"""NCCL issue order: the grouping rule, the replay that proves it, and the passes it needs."""

from __future__ import annotations

import doctest
import functools
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from syncline.errors import ConfigError
from syncline.schedule import (
    SCHEDULES,
    Action,
    ActionKind,
    Plan,
    Schedule,
    ScheduleError,
    Segment,
    add_communication,
    align_receives,
    build_plan,
    check_nccl_order,
    interleaved_1f1b,
    nccl_plan,
    p2p_batches,
    parse_action,
    validate,
)
from syncline.schedule import nccl as nccl_module
from syncline.schedule.ir import COMM
from syncline.schedule.nccl import STREAM_MODELS, receive_before_recompute

K = ActionKind
NAMES = SCHEDULES.names()  # at collection, before any test registers its own


def singles(actions: Sequence[Action]) -> list[tuple[int, int]]:
    """Today's runtime: one isend/irecv per SEND/RECV action."""
    return [(i, i + 1) for i, a in enumerate(actions) if a.kind in COMM]


@functools.cache
def plan_of(name: str, d: int, m: int, chunks: int = 1, recompute: bool = False) -> Plan:
    stages = d * chunks if SCHEDULES.get(name).interleaved else d
    return build_plan(name, num_ranks=d, num_stages=stages, num_microbatches=m, recompute=recompute)


@functools.cache
def safe_plan_of(name: str, d: int, m: int, chunks: int = 1, recompute: bool = False) -> Plan:
    return nccl_plan(plan_of(name, d, m, chunks, recompute))


def hand_plan(rows: dict[int, str], num_stages: int, m: int, stages_per_rank: int = 1) -> Plan:
    schedule = Schedule.from_strings("hand", num_stages, m, rows, stages_per_rank)
    validate(schedule)
    return Plan("hand", schedule, {"single": Segment("single", schedule.actions, 0)})


def acts(text: str) -> list[Action]:
    return [parse_action(t) for t in text.split()]


# -- the grouping rule -------------------------------------------------------------------------


def test_p2p_batches_literal() -> None:
    row = acts("0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0F2 0SEND_F2 0RECV_B1 0B1 0RECV_B2")
    assert p2p_batches(row) == [(1, 2), (3, 5), (7, 9), (10, 11)]
    assert p2p_batches(acts("0F0 0B0 0REDUCE 0STEP")) == []
    assert p2p_batches([]) == []


KINDS = [K.FORWARD, K.BACKWARD, K.RECOMPUTE, K.SEND_F, K.RECV_B, K.REDUCE, K.STEP]


@given(st.lists(st.sampled_from(KINDS), max_size=40))
def test_p2p_batches_are_the_maximal_runs(kinds: list[ActionKind]) -> None:
    row = [Action(1, k, None if k in (K.REDUCE, K.STEP) else 0) for k in kinds]
    ranges = p2p_batches(row)
    covered = [n for i, j in ranges for n in range(i, j)]
    assert covered == [n for n, a in enumerate(row) if a.kind in COMM]  # each once, in order
    for i, j in ranges:  # maximal: no SEND/RECV right before or after
        assert i == 0 or row[i - 1].kind not in COMM
        assert j == len(row) or row[j].kind not in COMM


# -- every registered schedule is safe in the order the runtime issues it ----------------------


@st.composite
def configs(draw: st.DrawFn) -> tuple[str, int, int, int, bool, int]:
    name = draw(st.sampled_from(NAMES))
    spec = SCHEDULES.get(name)
    d = draw(st.integers(2 if spec.interleaved else 1, 8))
    chunks = draw(st.integers(2, 4)) if spec.interleaved else 1
    m = draw(st.sampled_from([m for m in range(1, 33) if spec.rule(d, m) is None]))
    return name, d, m, chunks, draw(st.booleans()), draw(st.sampled_from([1, 2]))


@pytest.mark.slow  # 80 drawn schedules (~8 s); the small grid below is exhausted in every tier
@settings(max_examples=80, deadline=None)
@given(configs())
def test_every_schedule_is_safe_under_nccl(config: tuple[str, int, int, int, bool, int]) -> None:
    name, d, m, chunks, recompute, replicas = config
    check_nccl_order(safe_plan_of(name, d, m, chunks, recompute), replicas=replicas)


def test_small_grid_exhaustively() -> None:
    for name in NAMES:
        spec = SCHEDULES.get(name)
        for d in range(2 if spec.interleaved else 1, 5):
            for m in (m for m in range(1, 9) if spec.rule(d, m) is None):
                for recompute in (False, True):
                    check_nccl_order(safe_plan_of(name, d, m, 2, recompute))


def test_the_passes_apply_only_where_needed() -> None:
    for name, recompute in [("gpipe", False), ("gpipe", True), ("1f1b", False), ("1f1b", True)]:
        plan = plan_of(name, 4, 8, 1, recompute)
        assert nccl_plan(plan) is plan
    plan = plan_of("2bw", 4, 8)
    assert nccl_plan(plan) is plan
    for name, chunks, recompute in [("2bw", 1, True), ("interleaved", 2, False)]:
        plan = plan_of(name, 2, 4, chunks, recompute)
        with pytest.raises(ScheduleError, match="deadlock"):
            check_nccl_order(plan)
        assert safe_plan_of(name, 2, 4, chunks, recompute) is not plan
    # 2BW with recompute needs only the receive moved before the recompute
    fixed = safe_plan_of("2bw", 2, 4, 1, True)
    assert fixed.overlapping and set(fixed.segments) == set(plan_of("2bw", 2, 4).segments)
    assert "0SEND_F0@b1 0RECV_B3@b0 0R3@v0b0" in " ".join(
        map(str, fixed.segments["start"].at(0, 0))
    )


# -- today's runtime (one isend/irecv per action) deadlocks --------------------------------------


@pytest.mark.parametrize("model", STREAM_MODELS)
@pytest.mark.parametrize("m", [4, 8])
@pytest.mark.parametrize("name", ["1f1b", "2bw", "interleaved"])
def test_single_sends_and_receives_deadlock(name: str, m: int, model: str) -> None:
    with pytest.raises(ScheduleError, match=f"NCCL deadlock with '{model}' streams"):
        check_nccl_order(plan_of(name, 2, m, 2), streams=[model], grouping=singles)


@pytest.mark.parametrize("m", [4, 8])
def test_single_sends_and_receives_are_fine_for_gpipe(m: int) -> None:
    check_nccl_order(plan_of("gpipe", 2, m), grouping=singles)


def test_the_1f1b_deadlock_names_both_heads() -> None:
    with pytest.raises(ScheduleError) as info:
        check_nccl_order(plan_of("1f1b", 2, 4), streams=["pair"], grouping=singles)
    lines = str(info.value).splitlines()
    assert lines[1:3] == [
        "  rank 0, call 0 (single): at 0B0@b0: needs its RECV_B",
        "    0RECV_B0@b0 <- rank 1: queued behind [0SEND_F1@b0]",
    ]
    assert "    rank 0 to 1: [0SEND_F1@b0] (+1 queued)" in lines
    assert "    rank 1 to 0: [1SEND_B0@b0] (+1 queued)" in lines


def test_the_deadlock_names_replicas() -> None:
    with pytest.raises(ScheduleError, match=r"rank 3 \(pipeline rank 1, replica 1\)"):
        check_nccl_order(plan_of("1f1b", 2, 4), replicas=2, grouping=singles)


# -- literal cases -----------------------------------------------------------------------------

ONE_F_ONE_B = {
    0: "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 0REDUCE 0STEP",
    1: "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 1REDUCE 1STEP",
}


def test_literal_1f1b_single_ops_deadlock_groups_do_not() -> None:
    plan = hand_plan(ONE_F_ONE_B, 2, 2)
    with pytest.raises(ScheduleError, match="0SEND_F1@b0 -> rank 1: running, waits for"):
        check_nccl_order(plan, grouping=singles)
    check_nccl_order(plan)  # [0SEND_F1 0RECV_B0] meets [1SEND_B0 1RECV_F1]
    check_nccl_order(plan, grouping=singles, eager=True)  # small messages never wait


# rank 0 sends 2B0 then recomputes before receiving 2B1; rank 1 sends 3B1 then recomputes
# before receiving 1B0: both heads are lone sends whose receives wait behind the other's
RING = {
    0: "0F0 0SEND_F0 0F1 0SEND_F1 2RECV_F0 2F0 2SEND_F0 2RECV_F1 2F1 2SEND_F1 2RECV_B0 2B0 "
    "2SEND_B0 2R1 2RECV_B1 2B1 2SEND_B1 0RECV_B0 0B0 0RECV_B1 0B1",
    1: "1RECV_F0 1F0 1SEND_F0 1RECV_F1 1F1 1SEND_F1 3RECV_F0 3F0 3B0 3SEND_B0 3RECV_F1 3F1 "
    "3B1 3SEND_B1 1R0 1RECV_B0 1B0 1SEND_B0 1RECV_B1 1B1 1SEND_B1",
}


def test_literal_ring_deadlocks_even_grouped_and_both_passes_fix_it() -> None:
    plan = hand_plan(RING, 4, 2, stages_per_rank=2)
    with pytest.raises(ScheduleError) as info:
        check_nccl_order(plan)
    assert (
        "2SEND_B0@b0 -> rank 1: running, waits for 1RECV_B0@b0 <- rank 0 (queued behind "
        "[3SEND_B1@b0])" in str(info.value)
    )
    hoisted = {
        r: " ".join(map(str, receive_before_recompute(a))) for r, a in plan.schedule.actions.items()
    }
    assert "2SEND_B0 2RECV_B1 2R1 2B1" in hoisted[0] and "3SEND_B1 1RECV_B0 1R0" in hoisted[1]
    check_nccl_order(hand_plan(hoisted, 4, 2, stages_per_rank=2))
    aligned = align_receives(plan.schedule)
    check_nccl_order(hand_plan(aligned.to_strings(), 4, 2, stages_per_rank=2))


def test_messages_paired_out_of_order_are_an_error() -> None:
    rows = {
        0: ONE_F_ONE_B[0],
        1: "1RECV_F1 1F1 1RECV_F0 1F0 1B0 1SEND_B0 1B1 1SEND_B1 1REDUCE 1STEP",
    }
    with pytest.raises(ScheduleError, match="in issue order, but message 0 is 0SEND_F0@b0"):
        check_nccl_order(hand_plan(rows, 2, 2), eager=True)


def test_align_receives_keeps_everything_else_in_place() -> None:
    schedule = add_communication(interleaved_1f1b(4, 8, 3, recompute=True))
    aligned = align_receives(schedule)

    def sender(a: Action) -> int:  # the rank a receive comes from
        return schedule.rank_of(a.stage - 1 if a.kind is K.RECV_F else a.stage + 1)

    recv = (K.RECV_F, K.RECV_B)
    for r, row in schedule.actions.items():
        new = aligned.actions[r]
        assert [a for a in new if a.kind not in recv] == [a for a in row if a.kind not in recv]
        for peer in range(schedule.num_ranks):  # NCCL pairs each peer's messages in order
            assert [a for a in new if a.kind in recv and sender(a) == peer] == [
                a for a in row if a.kind in recv and sender(a) == peer
            ]

        def after(acts: Sequence[Action], a: Action) -> int:  # other actions before a
            return sum(b.kind not in recv for b in acts[: acts.index(a)])

        assert all(after(new, a) <= after(row, a) for a in row if a.kind in recv)  # up only
        assert new != row


# -- arguments ---------------------------------------------------------------------------------


def test_bad_arguments_are_refused_by_name() -> None:
    plan = plan_of("gpipe", 2, 2)
    with pytest.raises(ConfigError, match="replicas=0"):
        check_nccl_order(plan, replicas=0)
    with pytest.raises(ConfigError, match="streams='pair'"):
        check_nccl_order(plan, streams="pair")
    with pytest.raises(ConfigError, match="streams=\\['ring'\\]"):
        check_nccl_order(plan, streams=["ring"])
    with pytest.raises(
        ConfigError, match="kinds=\\['steady'\\]: gpipe has the calls \\['single'\\]"
    ):
        check_nccl_order(plan, kinds=["steady"])


def test_a_grouping_that_breaks_the_contract_is_refused() -> None:
    plan = plan_of("gpipe", 2, 2)
    with pytest.raises(ScheduleError, match="holds non-p2p actions"):
        check_nccl_order(plan, grouping=lambda a: [(0, len(a))])
    with pytest.raises(ScheduleError, match="are in no group"):
        check_nccl_order(plan, grouping=lambda a: [])


def test_docstring_examples() -> None:
    assert doctest.testmod(nccl_module).failed == 0
