"""``device_ids``/``output_device`` as DDP 2.13 takes them; a module off the GPU under NCCL refused.

No process group is needed (``DataParallel`` runs as one rank without one). Modules on the
``meta`` device stand in for a GPU module: DDP moves inputs for any non-CPU single-device
module, and a meta module's forward shows where its inputs arrived without computing.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, namedtuple
from typing import Any

import pytest
import torch
from torch import nn

from syncline import DataParallel
from syncline.comm import groups
from syncline.errors import ConfigError

Pair = namedtuple("Pair", ["x", "y"])


@dataclasses.dataclass
class Box:
    t: torch.Tensor


class Recorder(nn.Module):
    """Records the device of every tensor it is given, where it sits in the arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.seen: dict[str, Any] = {}

    def forward(self, a: Any, nested: Any, *, kw: Any = None) -> torch.Tensor:
        self.seen = {
            "a": a.device,
            "list": [t.device for t in nested["list"]],
            "tuple": type(nested["tuple"]).__name__,
            "tuple_dev": nested["tuple"][0].device,
            "pair": (type(nested["pair"]).__name__, nested["pair"].x.device),
            "ordered": type(nested["ordered"]).__name__,
            "ordered_dev": nested["ordered"]["k"].device,
            "box": nested["box"].t.device,
            "kw": kw.device,
            "scalar": nested["scalar"],
        }
        return self.lin(a)


def _inputs() -> tuple[tuple[Any, ...], dict[str, Any]]:
    cpu = torch.ones(2, 3)
    nested = {
        "list": [cpu, cpu],
        "tuple": (cpu,),
        "pair": Pair(cpu, 1),
        "ordered": OrderedDict(k=cpu),
        "box": Box(cpu),
        "scalar": 7,
    }
    return (cpu, nested), {"kw": cpu}


def _meta_recorder() -> Recorder:
    with torch.device("meta"):
        return Recorder()


def test_device_ids_move_nested_inputs_as_ddp_does() -> None:
    module = _meta_recorder()
    dp = DataParallel(module, device_ids=[0])
    assert dp.device_ids == [0] and dp.output_device == 0
    args, kwargs = _inputs()
    out = dp(*args, **kwargs)
    meta = torch.device("meta")
    assert out.device == meta
    seen = module.seen
    assert seen["a"] == meta and seen["kw"] == meta
    assert seen["list"] == [meta, meta]
    assert seen["tuple"] == "tuple" and seen["tuple_dev"] == meta
    assert seen["pair"] == ("Pair", meta)  # namedtuples keep their type
    assert seen["ordered"] == "OrderedDict" and seen["ordered_dev"] == meta
    assert seen["box"] == torch.device("cpu")  # DDP's _recursive_to leaves dataclasses
    assert seen["scalar"] == 7
    with torch.no_grad():  # evaluation forwards move their inputs too, as in DDP
        dp(*args, **kwargs)
    assert module.seen["a"] == meta


def test_without_device_ids_inputs_stay_where_they_are() -> None:
    module = _meta_recorder()
    dp = DataParallel(module)
    assert dp.device_ids is None and dp.output_device is None
    args, kwargs = _inputs()
    with pytest.raises((RuntimeError, NotImplementedError)):  # a CPU input meets meta weights
        dp(*args, **kwargs)
    assert module.seen["a"] == torch.device("cpu")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"device_ids": [0, 1]}, "single element"),
        ({"device_ids": [torch.device("cpu")]}, "not a device of the module's type 'meta'"),
        ({"device_ids": ["cuda:0"]}, "not a device of the module's type 'meta'"),
        ({"device_ids": [0.5]}, "not a device of the module's type"),
        ({"device_ids": [0], "output_device": "cpu"}, "output_device='cpu'"),
    ],
)
def test_bad_device_arguments_are_refused_up_front(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        DataParallel(_meta_recorder(), **kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [{"device_ids": [0]}, {"output_device": 1}, {"device_ids": [0], "output_device": 0}],
)
def test_a_cpu_module_takes_no_device_arguments(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="apply to a module on one GPU only"):
        DataParallel(nn.Linear(2, 2), **kwargs)


@pytest.mark.parametrize("kwargs", [{}, {"device_ids": None}, {"device_ids": []}])
def test_a_cpu_module_with_ddp_s_unset_values(kwargs: dict[str, Any]) -> None:
    dp = DataParallel(nn.Linear(2, 2), **kwargs)
    assert dp.device_ids is None and dp.output_device is None


def test_a_module_over_several_devices_is_refused() -> None:
    module = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    with pytest.raises(ConfigError, match=r"one device .*\['cpu', 'meta'\]"):
        DataParallel(module)


def test_nccl_refuses_a_module_off_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(groups, "backend_name", lambda group=None: "nccl")
    with pytest.raises(ConfigError, match=r"'nccl', which takes CUDA tensors only.*cpu"):
        DataParallel(nn.Linear(2, 2))
