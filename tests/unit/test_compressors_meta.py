"""Every compressor, the fp16 verdict and LAMB/LARS take no host sync in a steady-state step.

Why the ``meta`` device: a meta tensor has a shape and a dtype but no data, so anything that
reads a value on the host (``.item()``, ``.tolist()``, ``bool(t)``, ``nonzero()``, a boolean
mask index) raises, as a stand-in for a CUDA step that would stall the host there. torch's
``fake`` process group takes meta tensors and delivers nothing, so a compressor's whole reduce
path (scores, selection, payload, decompression) runs at world size 2 in this one process.
A collective that checks every tensor it is handed also proves that nothing reaches the
network on another device than the gradient's (a CPU tensor handed to NCCL fails there).

Restoring a checkpoint is covered too: compressor state saved on the CPU (as ``torch.load``
without ``map_location`` gives it back) must meet the next step's gradients on their device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from syncline.comm import FlatAllreduce, Pending
from syncline.dp.compression import BucketRef, Compressor, Layout
from syncline.dp.compressors import CSC, build_compressor
from syncline.dp.precision import LossScaler, unscale_and_flag
from syncline.dp.registry import COMPRESSORS
from syncline.optim import Lamb, Lars

META = torch.device("meta")
#: the second bucket has a short last chunk at chunk=8; the third is large enough for TopK's
#: sampled-threshold path (``syncline.dp.compressors.topk.top_indices``)
SIZES = (300, 77, 8192)
#: per bucket: ``(offset, shape)`` of its parameters (PowerSGD compresses per tensor)
LAYOUTS: tuple[Layout, ...] = (((0, (20, 15)),), ((0, (7,)), (7, (7, 10))), ((0, (64, 128)),))
STEPS = range(0, 5)  # step 0 is the engine's dense first step; 1.. the steady state

#: one spec per built-in compressor, and variants that take other branches of the same code
CASES: dict[str, Callable[[], Compressor]] = {
    "none": lambda: build_compressor("none"),
    "fp16": lambda: build_compressor("fp16"),
    "bf16": lambda: build_compressor("bf16"),
    "csc": lambda: build_compressor("csc:0.25:chunk=8:warmup=1"),
    "csc-exp-ramp": lambda: build_compressor("csc:0.05:chunk=8:warmup=3:ramp=exp"),
    "csc-fp32-wire": lambda: CSC(0.25, chunk_elems=8, warmup_steps=1, wire_dtype=torch.float32),
    "csc-bf16-wire": lambda: CSC(0.25, chunk_elems=8, wire_dtype=torch.bfloat16),
    "topk": lambda: build_compressor("topk:0.05"),
    "powersgd": lambda: build_compressor("powersgd:2:warmup=1"),
}
BUILT_IN = ("none", "fp16", "bf16", "csc", "topk", "powersgd")


@pytest.fixture(scope="module")
def fake_world() -> Iterator[None]:
    """Rank 0 of a fake world of 2 (collectives accept meta tensors and deliver nothing)."""
    dist.init_process_group("cpu:fake,cuda:fake,meta:fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield
    finally:
        dist.destroy_process_group()


class _OnDevice:
    """The real collective over the fake group, refusing tensors off ``device``."""

    def __init__(self, device: torch.device) -> None:
        self.inner = FlatAllreduce(timeout_s=10.0)
        self.device = device
        self.rank, self.world_size, self.timeout_s = 0, self.inner.world_size, 10.0
        self.handed: list[str] = []

    def _check(self, tensor: torch.Tensor, what: str) -> None:
        self.handed.append(what)
        assert tensor.device == self.device, f"{what}: a {tensor.device} tensor"

    def allreduce(self, tensor: torch.Tensor, what: str) -> Pending:
        self._check(tensor, what)
        return self.inner.allreduce(tensor, what)

    def allgather(self, tensor: torch.Tensor, what: str) -> tuple[Pending, list[torch.Tensor]]:
        self._check(tensor, what)
        return self.inner.allgather(tensor, what)


def _steps(comp: Compressor, device: torch.device, steps: range = STEPS) -> _OnDevice:
    """Reduce both buckets at each step as the engine does: every bucket submitted during
    backward (with a ``poll`` between), then every one waited for, in bucket order."""
    comm = _OnDevice(device)
    gen = torch.Generator().manual_seed(0)
    for step in steps:
        grads = [torch.randn(n, generator=gen).to(device) for n in SIZES]
        pendings = []
        for b, g in enumerate(grads):
            pendings.append(comp.reduce(BucketRef(b, step, LAYOUTS[b]), g, comm))
            poll = getattr(comp, "poll", None)
            if poll is not None:
                poll()
        for p in pendings:
            p.wait()
        for g in grads:
            assert g.device == device
    return comm


@pytest.mark.parametrize("case", list(CASES))
def test_compressor_steps_on_meta_without_a_host_sync(fake_world: None, case: str) -> None:
    comm = _steps(CASES[case](), META)
    assert comm.world_size == 2 and comm.handed  # the collectives were really called


@pytest.mark.parametrize("case", [c for c in CASES if not CASES[c]().stateless])
def test_restored_cpu_state_meets_the_gradients_on_their_device(
    fake_world: None, case: str
) -> None:
    """State saved on the CPU and loaded as it is (``torch.load`` without ``map_location``)
    goes to the gradients' device at the next step, which then runs with no host sync."""
    before = CASES[case]()
    _steps(before, torch.device("cpu"), range(0, 3))
    saved: dict[str, Any] = before.state_dict()
    assert any(t.device.type == "cpu" for d in saved["buckets"].values() for t in d.values())
    after = CASES[case]()
    after.load_state_dict(saved)
    _steps(after, META, range(3, 6))
    for bucket in after.state_dict()["buckets"].values():
        for name, t in bucket.items():
            if name != "credit":  # CSC's carried fraction of a chunk: a host counter
                assert t.device == META, (case, name)


def test_every_built_in_compressor_is_covered() -> None:
    assert set(BUILT_IN) <= set(COMPRESSORS.names()) and set(BUILT_IN) <= set(CASES)


def test_unscale_and_flag_on_meta() -> None:
    flag = None
    for n in SIZES:
        flag = unscale_and_flag(torch.empty(n, device=META), 1.0 / 1024, flag)
    assert flag is not None and flag.device == META and flag.numel() == 1


def test_the_overflow_verdict_is_one_device_flag(fake_world: None) -> None:
    """The verdict over every gradient (and a bucket's flag from the reduce) is one flag on
    the gradients' device, summed over the group; only ``overflowed`` reads it on the host."""
    grads = [torch.empty(n, device=META) for n in SIZES]
    local = unscale_and_flag(torch.empty(9, device=META), 0.5, None)
    flag = LossScaler().overflow_flag(grads, "verdict at step 1", local)
    assert flag.device == META and flag.numel() == 1


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: Lamb(ps, lr=0.01, weight_decay=0.01),
        lambda ps: Lars(ps, lr=1.0, weight_decay=1e-4),
    ],
    ids=["lamb", "lars"],
)
def test_layer_wise_optimizers_step_on_meta(make: Callable[[Any], Any]) -> None:
    params = [torch.nn.Parameter(torch.empty(s, device=META)) for s in ((8, 6), (8,), (3, 8))]
    for p in params:
        p.grad = torch.empty_like(p)
    opt = make(params)
    for _ in range(3):
        opt.step()
    assert all(p.device == META for p in params)
