"""DataParallel with its model on ``meta`` and torch's ``fake`` backend: every tensor it hands
to torch.distributed is on the model's device, and a steady-state step reads nothing back.

``meta`` stands in for a GPU (anything but the CPU): a tensor made without ``device=`` lands
on the CPU and is caught here, and ``.item()``, ``.tolist()``, ``nonzero()`` or ``bool()`` of a
meta tensor raise, so a host sync in the step fails the test. The reads that are not in the
steady state (the first step's bucket order, the tuning's times, find_unused_parameters'
counts) go through ``comm.collectives.host_list``, counted here per step.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

from syncline import DataParallel
from syncline.dp import autotune, reducer

_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "gather", "barrier", "all_gather_object")
META = torch.device("meta")


@pytest.fixture
def devices_seen(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, torch.device]]]:
    """A 2-rank fake default group (this process is rank 0); records the device of every
    tensor passed to a collective."""
    seen: list[tuple[str, torch.device]] = []
    for name in _COLLECTIVES:
        original = getattr(dist, name)

        def spy(*args: Any, _name: str = name, _f: Any = original, **kwargs: Any) -> Any:
            for a in (*args, *kwargs.values()):
                for t in a if isinstance(a, list) else [a]:
                    if isinstance(t, torch.Tensor):
                        seen.append((_name, t.device))
            return _f(*args, **kwargs)

        monkeypatch.setattr(dist, name, spy)
    dist.init_process_group("cpu:fake,cuda:fake,meta:fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield seen
    finally:
        dist.destroy_process_group()


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The host reads of DataParallel's own collectives, by caller."""
    calls: list[str] = []
    for module in (reducer, autotune):
        original = module.host_list

        def counted(t: torch.Tensor, *, meta: list[Any], _m: Any = module, _f: Any = original):
            calls.append(_m.__name__)
            return _f(t, meta=meta)

        monkeypatch.setattr(module, "host_list", counted)
    return calls


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.norm = nn.BatchNorm1d(8)  # buffers: broadcast before each training forward
        self.b = nn.Linear(8, 2)
        self.spare = nn.Linear(2, 2)  # used only on odd steps

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        y = self.b(torch.relu(self.norm(self.a(x))))
        return self.spare(y) if step % 2 else y


def _wrap(**kwargs: Any) -> DataParallel:
    with torch.device("meta"):
        net = _Net()
    return DataParallel(
        net,
        autotune_buckets=True,
        tune_steps_per_trial=1,
        tune_rounds=1,
        tune_final_rounds=1,
        tune_min_bucket_mb=1e-4,
        **kwargs,
    )


def test_steps_on_meta_hand_only_meta_tensors_and_read_nothing_when_steady(
    devices_seen: list[tuple[str, torch.device]], reads: list[str]
) -> None:
    dp = _wrap()
    x = torch.ones(3, 4, device=META)
    steps = 0
    while dp.tuning_pending:  # the first step re-lays the buffer; then the tuning measures
        dp(x, 1).sum().backward()
        steps += 1
        assert steps < 30, "the bucket tuning never decided"
    assert reads, "the first step's order and the tuning's times are read back"
    reads.clear()
    for _ in range(3):  # steady state
        dp(x, 1).sum().backward()
    with dp.no_sync():
        dp(x, 1).sum().backward()
    dp(x, 1).sum().backward()
    dp.sync_gradients()
    assert reads == []
    offenders = sorted({(n, str(d)) for n, d in devices_seen if d != META})
    assert offenders == []
    assert {n for n, _ in devices_seen} >= {"all_reduce", "broadcast", "all_gather"}


def test_find_unused_parameters_on_meta(
    devices_seen: list[tuple[str, torch.device]], reads: list[str]
) -> None:
    dp = _wrap(find_unused_parameters=True)
    x = torch.ones(3, 4, device=META)
    for step in range(4):
        dp(x, step).sum().backward()
    # the used-parameter counts: a host decision by nature (which gradients become None)
    assert reads.count("syncline.dp.reducer") >= 4
    assert sorted({(n, str(d)) for n, d in devices_seen if d != META}) == []
