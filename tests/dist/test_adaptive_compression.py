"""Every lossy compressor under AdamW and LAMB on 2 gloo ranks: supported pairs train, the
exact one is exact, and the one pair that applies momentum twice is refused up front.

The rules (``docs/compatibility.md``): fp16, bf16, TopK and PowerSGD leave momentum to the
optimizer and hand it the compressed average (TopK's and PowerSGD's error feedback keeps
what they did not send for the next steps), so Adam's moments see every gradient, late or
rounded; CSC owns a momentum of its own, which beside Adam's first moment would be momentum
twice: refused, and ``momentum=0`` (error feedback alone) is the supported form.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from syncline import DataParallel
from syncline.dp.compressors import CSC, build_compressor
from syncline.errors import ConfigError
from syncline.optim import Lamb
from syncline.testing import run_ranks

STEPS = 60
SPECS = ("none", "fp16", "bf16", "topk:0.1", "powersgd:2", "csc:0.1:chunk=16:momentum=0")


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed regression target (a random teacher), a fresh batch per rank and step."""
    gen = torch.Generator().manual_seed(7)
    teacher = torch.randn(16, 1, generator=gen)
    gen.manual_seed(1000 * rank + step)
    x = torch.randn(16, 16, generator=gen)
    return x, x @ teacher


def _optimizer(name: str, params):
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
    return Lamb(params, lr=1e-2, weight_decay=0.01)


def _train(optimizer: str, compressor, rank: int) -> tuple[list[float], list[torch.Tensor]]:
    dp = DataParallel(_net(), bucket_cap_mb=0.002, compression=compressor)  # 3 buckets
    opt = _optimizer(optimizer, dp.parameters())
    dp.attach(opt)  # checks the pair
    losses = []
    for step in range(STEPS):
        x, y = _batch(rank, step)
        opt.zero_grad()
        loss = F.mse_loss(dp(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in dp.parameters()]


def _pairs_rank(rank: int, world: int) -> dict:
    out = {}
    for optimizer in ("adamw", "lamb"):
        for spec in SPECS:
            out[optimizer, spec] = _train(optimizer, build_compressor(spec), rank)
        # CSC at density 1, fp32 on the wire, no momentum: the exact average, every step
        exact = CSC(1.0, chunk_elems=16, momentum=0.0, wire_dtype=torch.float32)
        out[optimizer, "csc:1:fp32"] = _train(optimizer, exact, rank)
    return out


@pytest.fixture(scope="module")
def pairs() -> dict:
    return run_ranks(_pairs_rank, 2)[0]


@pytest.mark.slow  # the pairs' runs: ~40 s on 2 CPU ranks
@pytest.mark.parametrize("optimizer", ["adamw", "lamb"])
@pytest.mark.parametrize("spec", SPECS)
def test_each_lossy_compressor_trains_under_an_adaptive_optimizer(pairs, optimizer, spec):
    """The mean loss of the last 10 steps is under 30 % of the first 10's, and under twice
    the uncompressed run's. Measured (first 10 -> last 10 of 60 steps; a linear teacher):

    ========================  ===============  ===============
    compressor                AdamW            LAMB
    ========================  ===============  ===============
    none, fp16, bf16          6.41 -> 0.467    9.52 -> 1.92
    powersgd:2                6.40 -> 0.489    9.52 -> 1.91
    topk:0.1                  7.23 -> 0.797    9.53 -> 1.86
    csc:0.1:momentum=0        7.60 -> 0.725    9.55 -> 2.35
    ========================  ===============  ===============

    The sparse ones (10 % of the gradient a step) trail under AdamW: Adam normalises each
    element by its own history, and an element sent once every few steps arrives as one
    large, rare gradient (error feedback delays it, it does not lose it)."""
    losses, _ = pairs[optimizer, spec]
    dense, _ = pairs[optimizer, "none"]
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < 0.3 * first, (first, last)
    assert last < 2.0 * sum(dense[-10:]) / 10, (last, dense[-10:])


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "lamb"])
def test_csc_without_momentum_at_density_1_in_fp32_is_the_exact_average(pairs, optimizer):
    _, dense = pairs[optimizer, "none"]
    _, csc = pairs[optimizer, "csc:1:fp32"]
    for p, q in zip(dense, csc, strict=True):
        assert torch.equal(p, q)


def _refusals_rank(rank: int, world: int) -> list[str]:
    found = []
    for make in (
        lambda ps: torch.optim.AdamW(ps, lr=1e-3),
        lambda ps: Lamb(ps, lr=1e-3),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    ):
        dp = DataParallel(_net(), compression=CSC(0.1))  # momentum 0.9, its default
        try:
            dp.attach(make(dp.parameters()))
        except ConfigError as exc:
            found.append(str(exc))
    dp = DataParallel(_net(), compression=CSC(0.1))
    dp.attach(torch.optim.SGD(dp.parameters(), lr=0.1))  # momentum 0: CSC's replaces it
    return found


def test_csc_momentum_beside_adam_lamb_or_sgd_momentum_is_refused_naming_the_pair() -> None:
    adamw, lamb, sgd = run_ranks(_refusals_rank, 2)[0]
    assert "compression 'csc' applies momentum 0.9 itself and AdamW keeps a first moment" in adamw
    assert "the compressor with momentum=0" in adamw
    assert "and Lamb keeps a first moment" in lamb
    assert "and SGD has momentum=0.9: momentum twice" in sgd
