"""The one bucket launch path (``syncline.dp.launches``) shared by ``DataParallel`` and a
pipeline stage's REDUCE, on a real one-rank gloo group: buckets start strictly in order and
only when complete, missing gradients count as zero, and each bucket reaches the compressor
under the caller's state key."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from syncline import comm
from syncline.dp.compression import NoCompression
from syncline.dp.compressors import PowerSGD
from syncline.dp.launches import BucketLaunches
from syncline.dp.layout import GradBuffer


@pytest.fixture
def flat() -> Iterator[comm.FlatAllreduce]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield comm.FlatAllreduce(dist.group.WORLD, timeout_s=30)
    finally:
        dist.destroy_process_group()


def _buffer(shapes: list[tuple[int, ...]], cap: int) -> tuple[list[torch.Tensor], GradBuffer]:
    params = [torch.zeros(s, requires_grad=True) for s in shapes]
    buf = GradBuffer(params, (cap, cap), keep_spent=False)
    buf.install(list(reversed(range(len(params)))))
    return params, buf


def test_buckets_start_in_order_and_only_when_complete(flat: comm.FlatAllreduce) -> None:
    params, buf = _buffer([(4,), (4,), (4,)], cap=16)  # one 16-byte parameter per bucket
    assert [b.params for b in buf.plan.buckets] == [(2,), (1,), (0,)]
    launches = BucketLaunches(buf, flat)
    launches.begin(0, NoCompression())
    for p, value in zip(params, (1.0, 2.0, 3.0), strict=True):
        p.grad = torch.full((4,), value)
    assert launches.final(0) == 0  # the last bucket is complete, the first two are not
    assert launches.final(2) == 1  # the first starts
    assert launches.final(1) == 2  # the second, then the waiting last one
    assert launches.next_bucket == 3 and len(launches.pending) == 3
    for pending in launches.pending:
        pending.wait()
    for p, value, view in zip(params, (1.0, 2.0, 3.0), buf.views, strict=True):
        assert p.grad is not None and p.grad.data_ptr() == view.data_ptr()
        assert torch.equal(p.grad, torch.full((4,), value))  # one rank: its own average


def test_missing_gradients_count_as_zero_and_receive_the_result(
    flat: comm.FlatAllreduce,
) -> None:
    params, buf = _buffer([(3,), (5,)], cap=1 << 20)
    launches = BucketLaunches(buf, flat, zero_missing=True)
    buf.views[0].fill_(7.0)  # stale bytes in the buffer must not leak into the reduction
    params[1].grad = torch.ones(5)
    launches.begin(0, NoCompression())
    launches.start_rest()
    for pending in launches.pending:
        pending.wait()
    assert params[0].grad is not None and torch.equal(params[0].grad, torch.zeros(3))
    assert params[0].grad.data_ptr() == buf.views[0].data_ptr()
    assert torch.equal(params[1].grad, torch.ones(5))


def test_rebind_keeps_the_plan_for_tensors_of_the_same_shapes() -> None:
    _, buf = _buffer([(2, 3), (4,)], cap=8)
    plan = buf.plan
    other = [torch.zeros(2, 3, requires_grad=True), torch.zeros(4, requires_grad=True)]
    assert buf.rebind(other) and buf.plan is plan and buf.params == other
    assert [m[0] for m in buf.members] == [[other[i] for i in b.params] for b in plan.buckets]
    assert not buf.rebind([torch.zeros(6, requires_grad=True), torch.zeros(4)])
    assert buf.params == other  # refused: nothing changed


def test_each_bucket_reaches_the_compressor_under_the_callers_key(
    flat: comm.FlatAllreduce,
) -> None:
    params, buf = _buffer([(8, 8), (8, 8)], cap=256)  # two buckets
    compressor = PowerSGD(rank=1)
    launches = BucketLaunches(buf, flat, key=lambda k: k * 4 + 3)  # bucket k of stage 3 of 4
    for p in params:
        p.grad = torch.randn(8, 8)
    launches.begin(1, compressor)
    launches.start_rest()
    for pending in launches.pending:
        pending.wait()
    assert sorted(compressor.state_dict()["buckets"]) == [3, 7]
