"""The ``sync=`` strategies on one process: their schedules, specs, state and refusals.

With no process group running, :class:`FlatAllreduce` is the world-size-1 collective, so
the strategies run their real code (the averaging of one rank changes nothing; DiLoCo's outer
step still moves the weights).
"""

from __future__ import annotations

import pytest
import torch

from syncline.comm import FlatAllreduce
from syncline.dp.periodic import DiLoCo, EveryStep, LocalSGD
from syncline.dp.syncs import build_sync, parse_sync, sync_forms
from syncline.errors import ConfigError

COMM = FlatAllreduce()


def _schedule(strategy, steps: int) -> tuple[str, str]:
    """Per step: G (gradients averaged) or L; and whether the replicas agree after it."""
    params = [torch.zeros(3, requires_grad=True)]
    reduces, agree = "", ""
    for _ in range(steps):
        strategy.before_step(params)
        reduces += "G" if strategy.reduces() else "L"
        strategy.after_step(params, COMM)
        agree += "=" if strategy.in_sync() else "."
    return reduces, agree


def test_the_schedules_of_the_module_docstring() -> None:
    assert _schedule(EveryStep(), 6) == ("GGGGGG", "======")
    assert _schedule(LocalSGD(4, start_step=2), 10) == ("GGLLLLLLLL", "===...=...")
    assert _schedule(DiLoCo(4, start_step=2), 10) == ("GGLLLLLLLL", "==...=...=")
    assert _schedule(LocalSGD(1), 3) == ("LLL", "===")


def test_specs_build_the_strategies_with_the_papers_defaults() -> None:
    assert "localsgd:PERIOD[:start=N]" in sync_forms()
    s = build_sync("localsgd:8:start=100")
    assert (s.period, s.start_step) == (8, 100)
    d = build_sync("diloco:50")
    assert (d.inner_steps, d.start_step, d.outer_lr, d.outer_momentum, d.nesterov) == (
        50, 0, 0.7, 0.9, True,
    )  # fmt: skip
    assert build_sync("diloco:5:outer_lr=0.5:outer_momentum=0:nesterov=0").outer_momentum == 0
    assert parse_sync("every-step")[1] == {}


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("localsgd", "localsgd needs its period"),
        ("localsgd:0", r"localsgd period=0 is invalid; valid: an integer >= 1"),
        ("localsgd:-2", r"localsgd period=-2 is invalid"),
        ("localsgd:2:start=-1", r"localsgd start=-1 is invalid; valid: an integer >= 0"),
        ("localsgd:2.5", r"period='2.5' is not an integer"),
        ("localsgd:2:warmup=3", r"unexpected 'warmup=3' \(options of localsgd: start=\)"),
        ("diloco:0", r"diloco inner_steps H=0 is invalid"),
        ("diloco:4:outer_lr=0", r"diloco outer_lr=0.0 is invalid; valid: a finite number > 0"),
        ("diloco:4:outer_momentum=1", r"outer_momentum=1.0 is invalid; valid: a number in \[0"),
        ("diloco:4:nesterov=2", r"nesterov=2 is invalid; valid: 0 or 1"),
        ("diloco:4:outer_momentum=0", r"nesterov=1 with outer_momentum=0 is invalid"),
        ("gossip:2", r"unknown sync 'gossip'.*valid forms: every-step, localsgd:PERIOD"),
    ],
)
def test_bad_specs_are_refused_naming_the_value(spec: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        build_sync(spec)


def test_diloco_state_round_trips_and_continues_bit_for_bit() -> None:
    def run(strategy, params, steps):
        for _ in range(steps):
            strategy.before_step(params)
            with torch.no_grad():
                params[0].add_(torch.arange(4.0) * 0.1 + strategy.step)  # a local "step"
            strategy.after_step(params, COMM)

    a, pa = DiLoCo(3), [torch.ones(4)]
    run(a, pa, 8)
    b, pb = DiLoCo(3), [torch.ones(4)]
    run(b, pb, 4)  # inside the second period
    c, pc = DiLoCo(3), [pb[0].clone()]
    c.load_state_dict(b.state_dict())
    run(c, pc, 4)
    assert c.step == a.step == 8
    assert torch.equal(pa[0], pc[0]) and torch.equal(a.outer, c.outer)
    assert torch.equal(a.momentum, c.momentum)
    assert not torch.equal(pa[0], torch.ones(4))
