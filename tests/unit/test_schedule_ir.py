"""The action IR: printing, parsing, construction checks, and the no-torch layering rule."""

from __future__ import annotations

import doctest
import importlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from syncline.schedule import Action, ActionKind, Schedule, ScheduleError, parse_action
from syncline.schedule.ir import PER_STAGE
from tests.zoo.fresh import run_python

K = ActionKind


@pytest.mark.parametrize(
    ("text", "action"),
    [
        ("1F0", Action(1, K.FORWARD, 0)),
        ("1B0", Action(1, K.BACKWARD, 0)),
        ("2R3", Action(2, K.RECOMPUTE, 3)),
        ("0SEND_F0", Action(0, K.SEND_F, 0)),
        ("1RECV_F0", Action(1, K.RECV_F, 0)),
        ("1SEND_B12", Action(1, K.SEND_B, 12)),
        ("0RECV_B7", Action(0, K.RECV_B, 7)),
        ("0REDUCE", Action(0, K.REDUCE)),
        ("0STEP", Action(0, K.STEP)),
        ("10F2", Action(10, K.FORWARD, 2)),
        ("1F0@v1b2", Action(1, K.FORWARD, 0, version=1, batch=2)),
        ("3B4@v0", Action(3, K.BACKWARD, 4, version=0)),
        ("0SEND_F1@b3", Action(0, K.SEND_F, 1, batch=3)),
        ("0REDUCE@b3", Action(0, K.REDUCE, batch=3)),
        ("0STEP@v1b0", Action(0, K.STEP, version=1, batch=0)),
    ],
)
def test_print_and_parse_literals(text: str, action: Action) -> None:
    assert str(action) == text
    assert parse_action(text) == action


@st.composite
def actions(draw: st.DrawFn) -> Action:
    kind = draw(st.sampled_from(list(ActionKind)))
    mb = None if kind in PER_STAGE else draw(st.integers(0, 200))
    optional = st.none() | st.integers(0, 50)
    return Action(draw(st.integers(0, 200)), kind, mb, draw(optional), draw(optional))


@given(actions())
def test_round_trip(action: Action) -> None:
    assert parse_action(str(action)) == action


@pytest.mark.parametrize(
    "text",
    ["", "F0", "1X0", "1F", "1F0@", "1F0@b1v1", "1F-1", "1 F0", "0REDUCE1", "0STEP2@v1", "1F0x"],
)
def test_parse_rejects_malformed(text: str) -> None:
    with pytest.raises(ScheduleError):
        parse_action(text)


def test_action_checks_its_fields() -> None:
    with pytest.raises(ScheduleError, match="stage=-1"):
        Action(-1, K.FORWARD, 0)
    with pytest.raises(ScheduleError, match="FORWARD needs a micro-batch"):
        Action(0, K.FORWARD)
    with pytest.raises(ScheduleError, match="STEP takes no micro-batch"):
        Action(0, K.STEP, 1)
    with pytest.raises(ScheduleError, match="version=-2"):
        Action(0, K.BACKWARD, 0, version=-2)


def test_schedule_strings_round_trip_and_freeze() -> None:
    rows = {0: "0F0 0B0 0REDUCE 0STEP", 1: "1F0 1B0 1REDUCE 1STEP"}
    schedule = Schedule.from_strings("x", 2, 1, rows)
    assert schedule.to_strings() == rows
    assert str(schedule) == "rank 0: 0F0 0B0 0REDUCE 0STEP\nrank 1: 1F0 1B0 1REDUCE 1STEP"
    mine = [parse_action("0F0")]
    frozen = Schedule("y", 1, 1, {0: mine})
    mine.append(parse_action("0B0"))
    assert frozen.actions[0] == (parse_action("0F0"),)


def test_schedule_shape_checks() -> None:
    with pytest.raises(ScheduleError, match="must all be >= 1"):
        Schedule("x", 0, 1, {})
    with pytest.raises(ScheduleError, match="must divide"):
        Schedule("x", 3, 1, {0: []}, stages_per_rank=2)
    with pytest.raises(ScheduleError, match=r"ranks \[0\], expected 0..1"):
        Schedule("x", 2, 1, {0: []})
    interleaved = Schedule("x", 4, 2, {0: [], 1: []}, stages_per_rank=2)
    assert interleaved.num_ranks == 2
    assert [interleaved.rank_of(s) for s in range(4)] == [0, 1, 0, 1]


def test_schedule_error_is_a_value_error() -> None:
    assert issubclass(ScheduleError, ValueError)


def test_import_does_not_load_torch() -> None:
    code = (
        "import sys\n"
        "import syncline.schedule, syncline.schedule.generators, syncline.schedule.ir\n"
        "import syncline.schedule.passes, syncline.schedule.render, syncline.schedule.validate\n"
        "syncline.schedule.validate(syncline.schedule.two_bw(3, 4, 2))\n"
        "assert 'torch' not in sys.modules, 'syncline.schedule imported torch'\n"
    )
    run_python(code)


@pytest.mark.parametrize("name", ["__init__", "generators", "ir", "passes", "render", "validate"])
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(f"syncline.schedule.{name}".removesuffix(".__init__"))
    result = doctest.testmod(module)
    assert result.failed == 0
