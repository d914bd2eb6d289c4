"""Any optimizer's state through the checkpoint formats, exactly, type for type (issue 39).

Every registered optimizer, a few of torch's with unusual state (L-BFGS: lists of tensors and
floats; Rprop, ASGD, Adagrad, Adafactor) and a plug-in's with ints, floats, None, bools,
strings and nested lists: after a few steps, its state goes through DCP (the periodic sharded
checkpoint, :func:`syncline.comm.sharded.save_sharded`, no process group) and through
``checkpoint.pt`` (``weights_only=True``), comes back equal entry for entry with the same
types, and a further step from the restored copy is bit-identical to one without the trip.
"""

from __future__ import annotations

import copy
import enum
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from syncline.comm.sharded import load_sharded, read_index, save_sharded
from syncline.errors import CheckpointError, ConfigError
from syncline.optim.registry import OPTIMIZERS
from syncline.train.checkpoint import load_checkpoint, save_checkpoint
from syncline.train.common import make_optimizer
from syncline.train.config import TrainConfig
from syncline.train.optim_state import (
    check_optimizer,
    dry_check,
    load_optimizer,
    optimizer_entries,
    optimizer_keys,
)
from tests.zoo.exact import assert_exact

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP without a process group


class Plugin(torch.optim.Optimizer):
    """A plug-in's optimizer (made up): SGD whose step reads plain Python state of every kind,
    so a continuation is exact only if each value comes back as itself."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr, "mode": "plain", "betas": (0.5, None)})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state.update(n=0, scale=1.0, last=None, warm=False, tag="a")
                    state.update(history=[[0, 0.5], (1, [True, None])], window=[p.clone()])
                    state["decay"] = torch.tensor(1.0)  # a 0-d tensor stays a tensor
                state["n"] += 1
                state["scale"] *= 0.75
                state["warm"] = state["n"] > 1
                state["last"] = None if state["last"] is None else state["last"] + 1
                state["tag"] += "b"
                state["history"][0].append(state["n"] / 3)
                state["window"].append(p.grad.clone())
                state["decay"].mul_(0.9)
                shrink = len(state["tag"]) * state["scale"] * (1.5 if state["warm"] else 1.0)
                p.add_(state["window"][-1] * state["decay"], alpha=-group["lr"] * shrink)
        return None


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5), nn.Linear(5, 3))


def _registered(name: str) -> Callable[[Any], torch.optim.Optimizer]:
    cfg = TrainConfig.from_flat(optimizer=name, lr=0.01, weight_decay=0.01)
    return lambda params: make_optimizer(cfg, list(params))


MAKERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    **{name: _registered(name) for name in OPTIMIZERS.names()},
    "torch-lbfgs": lambda ps: torch.optim.LBFGS(ps, lr=0.1, max_iter=3, history_size=2),
    "torch-rprop": lambda ps: torch.optim.Rprop(ps, lr=0.01),
    "torch-asgd": lambda ps: torch.optim.ASGD(ps, lr=0.01),
    "torch-adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.01),
    "torch-adafactor": lambda ps: torch.optim.Adafactor(ps, lr=0.01),
    "plugin": lambda ps: Plugin(ps),
}


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)
    return nn.functional.cross_entropy(model(x), y)


def _step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    def closure() -> float:
        opt.zero_grad()
        loss = _loss(model, step)
        loss.backward()
        return float(loss)

    closure()
    opt.step(closure)


def _trained(make: Callable[[Any], torch.optim.Optimizer]):
    model = _model()
    opt = make(model.parameters())
    for step in range(3):
        _step(model, opt, step)
    return model, opt, [n for n, _ in model.named_parameters()]


def _through_dcp(entries: dict[str, torch.Tensor], directory: Path, names: list[str]):
    save_sharded(entries, directory, group=None)
    return load_sharded(directory, optimizer_keys(read_index(directory), names), group=None)


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_state_round_trips_exactly_and_the_next_step_is_bit_identical(tmp_path, name) -> None:
    make = MAKERS[name]
    model, opt, names = _trained(make)
    assert opt.state_dict()["state"], "the optimizer kept no state: nothing was tested"
    got = _through_dcp(optimizer_entries(opt, names), tmp_path / "dcp", names)
    twin = copy.deepcopy(model)
    restored = make(twin.parameters())
    restored.param_groups[0]["lr"] = 123.0  # the checkpoint's hyper-parameters win
    load_optimizer(restored, names, got)
    assert_exact(opt.state_dict(), restored.state_dict(), name)
    # checkpoint.pt: the whole state_dict, read back with weights_only=True
    save_checkpoint(tmp_path / "checkpoint.pt", {"optimizer": opt.state_dict()})
    assert_exact(opt.state_dict(), load_checkpoint(tmp_path / "checkpoint.pt")["optimizer"], name)
    _step(model, opt, 3)
    _step(twin, restored, 3)
    for (key, a), b in zip(model.state_dict().items(), twin.state_dict().values(), strict=True):
        assert torch.equal(a, b), (name, key)
    assert_exact(opt.state_dict(), restored.state_dict(), f"{name} after a step")


def test_a_checkpoint_split_across_optimizers_loads_into_one(tmp_path) -> None:
    """A pipeline's stages each write their optimizer's entries (their plain values under
    their own key); a resharded run's single optimizer finds every parameter's among them."""
    model = _model()
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    halves = [Plugin(params[:2]), Plugin(params[2:])]
    for step in range(2):
        for opt in halves:
            opt.zero_grad()
        _loss(model, step).backward()
        for opt in halves:
            opt.step()
    entries = {**optimizer_entries(halves[0], names[:2]), **optimizer_entries(halves[1], names[2:])}
    assert sorted(k for k in entries if k.startswith("optim-values/")) == [
        f"optim-values/{names[0]}",
        f"optim-values/{names[2]}",
    ]
    whole = Plugin(copy.deepcopy(model).parameters())
    load_optimizer(whole, names, _through_dcp(entries, tmp_path, names))
    want = [s for opt in halves for s in opt.state_dict()["state"].values()]
    assert_exact(want, list(whole.state_dict()["state"].values()), "state")


class _Opaque:
    pass


class _Level(enum.IntEnum):
    HIGH = 1


@pytest.mark.parametrize(
    ("put", "named"),
    [
        (lambda opt, p: opt.state[p].update(cache=_Opaque()), "state 0.weight/cache is "),
        (lambda opt, p: opt.state[p].update(n=[1, {"x": _Level.HIGH}]), "['x'] is "),
        (lambda opt, p: opt.param_groups[0].update(mode=_Opaque()), "hyper-parameter 'mode'"),
        (lambda opt, p: opt.state[p].update(keys={_Opaque(): 1}), "has a key"),
    ],
)
def test_anything_but_plain_data_is_refused_by_name(put, named) -> None:
    """An object the checkpoint cannot rebuild exactly (an arbitrary class; an IntEnum would
    come back as an int, or not at all) is refused, naming the optimizer, entry and type."""
    model, opt, names = _trained(MAKERS["plugin"])
    put(opt, next(iter(model.parameters())))
    with pytest.raises(CheckpointError, match=r"^Plugin: ") as info:
        optimizer_entries(opt, names)
    message = str(info.value)
    assert named in message and "plain values" in message, message
    assert ("_Opaque" in message or "_Level" in message) or "has a key" in message, message
    with pytest.raises(CheckpointError):
        check_optimizer(opt, names)


class _Hoarder(Plugin):
    """A plug-in whose first step stores an object no checkpoint can hold."""

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        super().step(closure)
        for p in self.param_groups[0]["params"]:
            self.state[p]["cache"] = _Opaque()
        return None


def test_an_optimizer_that_cannot_be_checkpointed_is_refused_before_training(monkeypatch):
    """The dry check steps the optimizer on stand-in parameters: ``syncline train``'s
    preflight refuses it with one line naming the option, before any process starts."""
    with pytest.raises(CheckpointError, match=r"state matrix/cache is .*_Opaque"):
        dry_check(lambda ps: _Hoarder(ps))
    for name in OPTIMIZERS.names():  # every registered optimizer passes
        dry_check(_registered(name))
    from syncline.train import common, preflight

    monkeypatch.setattr(common, "make_optimizer", lambda cfg, params: _Hoarder(params))
    with pytest.raises(ConfigError, match=r"^optimizer='lamb': _Hoarder: state matrix/cache"):
        preflight._check_optimizer(TrainConfig.from_flat(optimizer="lamb"))
