"""CSC's stabilisers at high sparsity: the derived chunk size, DGC's local gradient clipping,
the warm-up schedule and the residual bound, against literal tables and references.

With no process group running, :class:`FlatAllreduce` is the real world-size-1 collective;
a world of ``p`` ranks is played by a stand-in that reports ``world_size = p`` and sums
nothing (what matters here is what a rank does before it sends).
"""

from __future__ import annotations

import itertools
import math
import re

import pytest
import torch

from syncline.comm import FlatAllreduce, Pending
from syncline.comm.collectives import completed
from syncline.dp.chunk_size import derive_chunk_elems
from syncline.dp.compression import BucketRef, Layout
from syncline.dp.compressors import CSC, build_compressor
from syncline.dp.compressors import chunks as ch
from syncline.dp.traffic import csc as csc_traffic
from syncline.errors import ConfigError

COMM = FlatAllreduce()


class _World:
    """A collective of ``world_size`` ranks whose others all send what this one does
    (the sum is ``world_size`` times the input): enough to test per-rank arithmetic."""

    rank = 0
    timeout_s = 60.0

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    def allreduce(self, t: torch.Tensor, what: str) -> Pending:
        t.mul_(self.world_size)
        return completed(what)


def _reduce(comp, grad, step=1, index=0, layout: Layout = (), comm=COMM) -> torch.Tensor:
    out = grad.clone()
    comp.reduce(BucketRef(index, step, layout), out, comm).wait()
    return out


def _grad(seed: int, n: int, scale: float = 1.0) -> torch.Tensor:
    return scale * torch.randn(n, generator=torch.Generator().manual_seed(seed))


# -- chunk size derived from the bucket and the density (pure) -----------------------
@pytest.mark.parametrize(
    ("numel", "density", "chunk"),
    [
        (2_978_560, 0.01, 1024),  # the 4 x 256 GPT's large bucket: 8 / 0.01 = 800 -> 1024
        (328_448, 0.01, 1024),  # its 1 MiB first bucket: 29 chunks of 1024 due per step... 3
        (570_112, 0.01, 1024),  # the default GPT's second bucket
        (50_000, 0.01, 256),  # 1 % of it is 500: no chunk larger than one step's share
        (100, 0.01, 1),  # a tiny bucket: one element a step
        (300_000, 0.1, 128),  # 8 / 0.1 = 80 -> 128
        (10**9, 0.001, 8192),
        (10**12, 1e-6, 32768),  # at most the old fixed default
        (1000, 1.0, 8),
    ],
)
def test_derived_chunk_size_table(numel: int, density: float, chunk: int) -> None:
    assert derive_chunk_elems(numel, density) == chunk
    assert ch.derive_chunk_elems is derive_chunk_elems  # CSC and the planner use one rule


@pytest.mark.parametrize("density", [1e-4, 0.001, 0.01, 0.05, 0.1, 0.3, 1.0])
@pytest.mark.parametrize("numel", [1, 7, 1000, 65_536, 328_448, 3_000_000, 10**8])
def test_derived_chunk_size_promises(numel: int, density: float) -> None:
    """A power of two; at least one chunk due per step; scores within a quarter of the
    payload unless that would break the first promise."""
    c = derive_chunk_elems(numel, density)
    assert c >= 1 and c & (c - 1) == 0 and c <= 32768
    assert c <= max(1.0, density * numel)  # every step sends at least one chunk
    if c < max(1.0, density * numel) / 2 and c < 32768:  # not cut by the share or the cap
        assert 0.25 * 2 * density * c * (1 + 1e-9) >= 4  # score <= 1/4 of its payload


def test_csc_uses_the_derived_chunk_per_bucket_and_an_explicit_one_as_given() -> None:
    auto, fixed = CSC(0.01), CSC(0.01, chunk_elems=32768)
    assert auto.chunk_elems is None and fixed.chunk_elems == 32768
    assert [auto.chunk_size(n) for n in (328_448, 50_000, 100)] == [1024, 256, 1]
    assert fixed.chunk_size(100) == 32768
    assert build_compressor("csc:0.01").chunk_size(2_978_560) == 1024  # type: ignore[attr-defined]
    # the planner prices the same chunks
    chunks = math.ceil(2_978_560 / 1024)
    assert csc_traffic(2_978_560, [], 4, density=0.01)[0] == ("allreduce", 4 * (chunks + 1))


def test_csc_sends_derived_chunks() -> None:
    """A bucket of 50,000 elements at 1 %: chunks of 256, and every step sends one or two
    (500 elements due a step), never one in many steps."""
    csc = CSC(0.01, momentum=0.0, wire_dtype=torch.float32)
    sent = []
    for step in range(1, 9):
        _reduce(csc, _grad(step, 50_000), step)
        sent.append(csc.last_selection[0].numel())
    assert all(k in (1, 2) for k in sent) and sum(sent) == math.floor(8 * 0.01 * 196)


# -- DGC's local gradient clipping ---------------------------------------------------
LAYOUT: Layout = ((0, (6, 5)), (30, (5,)), (35, (2, 3)))


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("clip", [0.5, 3.0, 100.0])
def test_clipping_equals_clip_grad_norm_per_tensor(world: int, clip: float) -> None:
    """What enters the momentum is each tensor's gradient clipped as
    ``torch.nn.utils.clip_grad_norm_(tensor, clip / sqrt(world))`` would, bit for bit."""
    g = _grad(0, 41, scale=2.0)
    g[35:].mul_(1e-3)  # one tensor under the threshold: left as it is
    csc = CSC(1.0, momentum=0.0, clip=clip, wire_dtype=torch.float32)
    csc.absorb(0, torch.zeros(41))  # creates the state; u = 0
    _reduce(csc, g, step=0, layout=LAYOUT, comm=_World(world))
    want = []
    for offset, shape in LAYOUT:
        p = torch.nn.Parameter(torch.zeros(shape))
        p.grad = g[offset : offset + math.prod(shape)].view(shape).clone()
        torch.nn.utils.clip_grad_norm_([p], clip / math.sqrt(world))
        want.append(p.grad.reshape(-1))
    assert torch.equal(csc.state_dict()["buckets"][0]["u"], torch.cat(want))


def test_clipping_without_a_layout_clips_the_bucket_as_one_tensor() -> None:
    g = _grad(1, 40, scale=3.0)
    csc = CSC(1.0, momentum=0.0, clip=1.0, wire_dtype=torch.float32)
    _reduce(csc, g, step=0)
    p = torch.nn.Parameter(torch.zeros(40))
    p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_([p], 1.0)
    assert torch.equal(csc.state_dict()["buckets"][0]["u"], p.grad)


def test_clip_zero_changes_no_bit() -> None:
    """``clip=0`` (the default) is the unclipped arithmetic exactly."""
    a, b = CSC(0.2, chunk_elems=4, clip=0.0), CSC(0.2, chunk_elems=4)
    for step in range(1, 6):
        g = _grad(10 + step, 64, scale=50.0)
        assert torch.equal(_reduce(a, g, step, layout=((0, (8, 8)),)), _reduce(b, g, step))
    assert torch.equal(a.state_dict()["buckets"][0]["v"], b.state_dict()["buckets"][0]["v"])


def test_clip_is_validated_and_parsed() -> None:
    with pytest.raises(ConfigError, match=re.escape("CSC: clip=-1.0 is invalid")):
        CSC(0.1, clip=-1.0)
    assert build_compressor("csc:0.01:clip=2.5").clip == 2.5  # type: ignore[attr-defined]


# -- the exponential warm-up (DGC) ------------------------------------------------------
def test_exp_warmup_schedule_is_density_to_the_fraction_done() -> None:
    csc = CSC(0.01, warmup_steps=100, ramp="exp")
    got = [csc.density_at(t) for t in (0, 25, 50, 75, 100, 1000)]
    want = [1.0, 0.01**0.25, 0.1, 0.01**0.75, 0.01, 0.01]
    assert got == pytest.approx(want, rel=1e-12)
    # it falls monotonically from dense to the target
    ramp = [csc.density_at(t) for t in range(101)]
    assert all(a >= b for a, b in itertools.pairwise(ramp))


# -- the residual bound ---------------------------------------------------------------
def test_bound_scales_each_tensors_residual_to_bound_times_its_momentum() -> None:
    """With nothing due (one chunk at 1 %: the budget reaches it at step 100), ``v`` sums
    the velocity; each tensor's ``v`` is then scaled to ``bound * ||u||`` at most, in the
    ratio a reference computes, and a tensor under the bound is left as it is."""
    bound, m = 2.0, 0.5
    csc = CSC(0.01, chunk_elems=64, momentum=m, bound=bound, wire_dtype=torch.float32)
    free = CSC(0.01, chunk_elems=64, momentum=m, wire_dtype=torch.float32)
    u = torch.zeros(41)
    v = torch.zeros(41)
    for step in range(1, 6):
        g = _grad(step, 41)
        g[30:35] = 0.0  # the bias gets no gradient: its u decays, its v must be bounded
        assert not _reduce(csc, g, step, layout=LAYOUT).any()  # nothing due: nothing sent
        _reduce(free, g, step, layout=LAYOUT)
        u.mul_(m).add_(g)
        v.add_(u)
        for offset, shape in LAYOUT:
            s = slice(offset, offset + math.prod(shape))
            ratio = bound * u[s].norm() / (v[s].norm() + 1e-12)
            v[s].mul_(min(1.0, float(ratio)))
        state = csc.state_dict()["buckets"][0]
        assert torch.equal(state["u"], u)
        torch.testing.assert_close(state["v"], v, rtol=1e-6, atol=0)
        for offset, shape in LAYOUT:
            s = slice(offset, offset + math.prod(shape))
            assert state["v"][s].norm() <= bound * state["u"][s].norm() * (1 + 1e-6)
    assert free.state_dict()["buckets"][0]["v"].norm() > v.norm()  # the bound did bind


def test_bound_zero_changes_no_bit_and_is_validated() -> None:
    a, b = CSC(0.2, chunk_elems=4, bound=0.0), CSC(0.2, chunk_elems=4)
    for step in range(1, 6):
        g = _grad(20 + step, 64)
        assert torch.equal(_reduce(a, g, step, layout=((0, (8, 8)),)), _reduce(b, g, step))
    with pytest.raises(ConfigError, match=re.escape("CSC: bound=-2.0 is invalid")):
        CSC(0.1, bound=-2.0)
    assert build_compressor("csc:0.01:bound=8").bound == 8.0  # type: ignore[attr-defined]
