"""The non-finite guard's parts on one process: its config, the verdict from an averaged tail,
and the optimizer step the device cancels (bit-exact against never calling the optimizer)."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from syncline.dp.guard import VERDICT_FIELDS, StepGuard
from syncline.dp.guard_config import GuardConfig
from syncline.errors import ConfigError
from syncline.optim.lamb import Lamb
from syncline.optim.lars import Lars
from syncline.optim.skip import fused_capable, step_unless
from syncline.train.config import TrainConfig
from syncline.train.guarding import batch_of

CPU = torch.device("cpu")


# -- config ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"on_nonfinite": "halt"}, "on_nonfinite='halt' is unknown; valid: off, stop, skip"),
        ({"on_nonfinite": "skip", "skip_batches": 0}, "skip_batches=0 is invalid"),
        ({"on_nonfinite": "skip", "spike_factor": 1.0}, "spike_factor=1.0 is invalid"),
        ({"spike_factor": 3.0}, "spike_factor=3.0 needs a guard"),
        ({"on_nonfinite": "skip", "spike_window": 2}, "spike_window=2 is invalid"),
        ({"on_nonfinite": "skip", "inject_nonfinite": "1"}, "must look like RANK:STEP[:KIND]"),
        ({"on_nonfinite": "skip", "inject_nonfinite": "1:2:inf"}, "must look like"),
        ({"inject_nonfinite": "1:2"}, "needs a guard"),
    ],
)
def test_guard_config_refuses_bad_values_by_name(values: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        GuardConfig(**values)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"compression": "csc:0.01"}, "compression='csc:0.01' is not supported"),
        ({"compression": "powersgd:2"}, "is not supported"),
        ({"precision": "fp16"}, "precision=fp16 is not supported"),
        ({"optimizer": "lamb"}, "optimizer='lamb' is not supported"),
        ({"sync": "localsgd:4"}, "sync='localsgd:4' is not supported"),
        ({"sync": "diloco:8"}, "sync='diloco:8' is not supported"),
        ({"pipeline_stages": 2}, "not supported with pipeline_stages=2"),
        ({"inject_nonfinite": "2:1"}, r"rank must be in \[0, 2\)"),
        ({"inject_nonfinite": "1:300"}, r"step in \[0, steps=300\)"),
    ],
)
def test_train_config_refuses_what_the_guard_cannot_run_with(
    values: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        TrainConfig.from_flat(on_nonfinite="skip", nproc_per_node=2, **values)


def test_guard_settings_are_a_part_of_the_train_config() -> None:
    cfg = TrainConfig.from_flat(on_nonfinite="rollback", skip_batches=3, spike_factor=4.0)
    assert cfg.guard == GuardConfig("rollback", 3, 4.0)
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    assert not TrainConfig().guard.on  # off by default: no tail, no cost


# -- the verdict -----------------------------------------------------------------------------
def _guard(action: str = "skip", **kw: Any) -> StepGuard:
    guard = StepGuard(GuardConfig(on_nonfinite=action, **kw))
    guard.attach(CPU, ["a", "b", "c"])
    return guard


def _step(guard: StepGuard, grads: list[torch.Tensor], loss: float, peer: float = 0.0) -> dict:
    """One rank's step with a peer whose flag is ``peer`` and whose loss equals ours: the
    tail as the averaging allreduce of two ranks leaves it."""
    guard.begin()
    guard.watch_loss(torch.tensor(loss))
    guard.observe(grads, (0, 1, 2))
    tail = torch.zeros(2)
    guard.fill_tail(tail)
    tail = (tail + torch.tensor([peer, loss])) / 2
    guard.settle(tail)
    return dict(zip(VERDICT_FIELDS, guard.verdict.tolist(), strict=True))


def test_a_nan_on_either_rank_is_an_event_on_both_naming_the_first_parameter() -> None:
    fine = [torch.ones(2), torch.ones(3), torch.ones(1)]
    assert _step(_guard(), fine, 1.0)["event"] == 0
    bad = [torch.ones(2), torch.tensor([1.0, math.nan, 1.0]), torch.tensor([math.inf])]
    mine = _step(_guard(), bad, 1.0)
    assert (mine["event"], mine["nonfinite"], mine["local"], mine["first_bad"]) == (1, 1, 1, 1)
    peers = _step(_guard(), fine, 1.0, peer=1.0)  # the peer saw one; this rank did not
    assert (peers["event"], peers["local"], peers["first_bad"]) == (1, 0, 3)
    assert _guard().name_of(1) == "b" and _guard().name_of(3) is None
    assert _step(_guard(), fine, math.inf)["event"] == 1  # a non-finite loss


def test_a_spike_is_judged_against_the_median_of_a_full_window_of_good_losses() -> None:
    guard = _guard(spike_factor=3.0, spike_window=3)
    fine = [torch.ones(1)]
    assert _step(guard, fine, 10.0)["event"] == 0  # the window is not full: no judgement
    for loss in (1.0, 2.0, 3.0):
        assert _step(guard, fine, loss)["event"] == 0
    spike = _step(guard, fine, 7.0)  # median 2, factor 3: above 6
    assert (spike["event"], spike["spike"], spike["nonfinite"], spike["median"]) == (1, 1, 0, 2)
    assert guard.window.tolist() == [1.0, 2.0, 3.0]  # an event's loss stays out
    assert _step(guard, fine, 5.9)["event"] == 0


def test_stop_and_rollback_latch_until_cleared_skip_does_not() -> None:
    fine, bad = [torch.ones(1)], [torch.tensor([math.nan])]
    skip, stop = _guard("skip"), _guard("stop")
    for guard in (skip, stop):
        _step(guard, bad, 1.0)
    assert _step(skip, fine, 1.0)["skip"] == 0
    after = _step(stop, fine, 1.0)
    assert (after["event"], after["skip"]) == (0, 1)  # not an event, but still dropped
    stop.clear_latch()
    assert _step(stop, fine, 1.0)["skip"] == 0


def test_a_spike_test_without_the_loss_is_refused() -> None:
    guard = _guard(spike_factor=3.0)
    guard.begin()
    with pytest.raises(RuntimeError, match="watch_loss"):
        guard.settle(torch.zeros(2))


# -- the optimizer step the device cancels ---------------------------------------------------
OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd-fused": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=0.1, fused=True),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=0.1),
    "sgd-foreach": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "lars": lambda ps: Lars(ps, lr=0.1, momentum=0.9),
}


@pytest.mark.parametrize("skipped", [0, 2])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_cancelled_step_equals_never_calling_the_optimizer(name: str, skipped: int) -> None:
    """Bit for bit, parameters and state, also when the cancelled step is the first (whose
    state the step creates; the fused path is used once state exists)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    ref = copy.deepcopy(net)
    opt, ref_opt = OPTIMIZERS[name](net.parameters()), OPTIMIZERS[name](ref.parameters())
    grads = [[torch.randn_like(p) for p in net.parameters()] for _ in range(5)]
    for t, step_grads in enumerate(grads):
        for p, g in zip(net.parameters(), step_grads, strict=True):
            p.grad = g * math.nan if t == skipped else g.clone()
        step_unless(opt, torch.tensor(float(t == skipped)))
        if t != skipped:
            for p, g in zip(ref.parameters(), step_grads, strict=True):
                p.grad = g.clone()
            ref_opt.step()
    for a, b in zip(net.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(opt.state.values(), ref_opt.state.values(), strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(torch.as_tensor(a[key]), torch.as_tensor(b[key])), key
    assert fused_capable(opt) == name.endswith("-fused")


def test_an_optimizer_with_python_number_state_is_refused_by_name() -> None:
    net = torch.nn.Linear(2, 2)
    opt = Lamb(net.parameters(), lr=0.1)
    for p in net.parameters():
        p.grad = torch.ones_like(p)
    with pytest.raises(ConfigError, match="Lamb keeps non-tensor state"):
        step_unless(opt, torch.tensor(0.0))


def test_batch_of_leaves_the_skipped_batches_out_of_the_stream() -> None:
    assert [batch_of(s, []) for s in range(4)] == [0, 1, 2, 3]
    assert [batch_of(s, [2, 3]) for s in range(4)] == [0, 1, 4, 5]
    assert [batch_of(s, [0, 5]) for s in range(6)] == [1, 2, 3, 4, 6, 7]
