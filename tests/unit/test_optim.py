"""LARS and LAMB: checked against the papers' formulas and against torch-optimizer's Lamb."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from syncline.errors import ConfigError
from syncline.optim import Lamb, Lars


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.ReLU(), nn.Linear(8, 3))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 6, scale: float = 1.0):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
        opt.zero_grad()
        (scale * nn.functional.cross_entropy(model(x), y)).backward()
        opt.step()
    return model


def _lars_oracle(model: nn.Module, lr, momentum, wd, eta, eps, steps=6) -> nn.Module:
    """You et al. 2017, Algorithm 1, one tensor at a time, in plain float64 arithmetic."""
    bufs: dict[int, torch.Tensor] = {}
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        with torch.no_grad():
            for p in model.parameters():
                grad = p.grad.double()
                w = p.double()
                if p.dim() > 1:
                    grad = grad + wd * w
                    wn, gn = float(w.norm()), float(grad.norm())
                    grad = grad * (eta * wn / (gn + eps) if wn > 0 and gn > 0 else 1.0)
                buf = bufs[id(p)] = grad if id(p) not in bufs else momentum * bufs[id(p)] + grad
                p.copy_((w - lr * buf).float())
    return model


def test_lars_follows_the_paper() -> None:
    args = {"lr": 2.0, "momentum": 0.9, "weight_decay": 5e-4, "trust_coefficient": 0.02}
    model = _model()
    got = _train(model, Lars(model.parameters(), **args))
    want = _lars_oracle(_model(), 2.0, 0.9, 5e-4, 0.02, 1e-8)
    for a, b in zip(got.parameters(), want.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def _lamb_oracle(model: nn.Module, lr, betas, eps, wd, clamp, steps=6) -> nn.Module:
    """You et al. 2019, Algorithm 2 (bias-corrected moments), in plain float64 arithmetic."""
    moments: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    g = torch.Generator().manual_seed(1)
    for t in range(1, steps + 1):
        x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        with torch.no_grad():
            for p in model.parameters():
                grad, w = p.grad.double(), p.double()
                m, v = moments.get(id(p), (torch.zeros_like(w), torch.zeros_like(w)))
                m, v = betas[0] * m + (1 - betas[0]) * grad, betas[1] * v + (1 - betas[1]) * grad**2
                moments[id(p)] = (m, v)
                r = (m / (1 - betas[0] ** t)) / ((v / (1 - betas[1] ** t)).sqrt() + eps)
                if p.dim() > 1:
                    r = r + wd * w
                    wn, rn = min(float(w.norm()), clamp), float(r.norm())
                    r = r * (wn / rn if wn > 0 and rn > 0 else 1.0)
                p.copy_((w - lr * r).float())
    return model


def test_lamb_follows_the_paper() -> None:
    model = _model()
    got = _train(model, Lamb(model.parameters(), lr=0.01, betas=(0.9, 0.99), weight_decay=0.01))
    want = _lamb_oracle(_model(), 0.01, (0.9, 0.99), 1e-6, 0.01, 10.0)
    for a, b in zip(got.parameters(), want.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_lamb_matches_torch_optimizer() -> None:
    """Against torch-optimizer's Lamb where the two formulations coincide: without weight
    decay the trust ratio cancels the bias correction, so its ``debias=False`` is the
    paper's step (its ``debias=True`` scales the step after the ratio, another variant)."""
    torch_optimizer = pytest.importorskip("torch_optimizer")
    mine, ref = _model(), _model()
    args = {"lr": 0.01, "betas": (0.9, 0.99), "eps": 1e-12}
    _train(mine, Lamb(mine.parameters(), clamp=10.0, adapt_1d=True, **args))
    _train(ref, torch_optimizer.Lamb(ref.parameters(), clamp_value=10.0, debias=False, **args))
    for a, b in zip(mine.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    start = _model()
    assert all(
        not torch.equal(a, b) for a, b in zip(mine.parameters(), start.parameters(), strict=True)
    )


@pytest.mark.parametrize("make", [lambda ps: Lars(ps, lr=1.0), lambda ps: Lamb(ps, lr=0.01)])
def test_the_trust_ratio_makes_each_matrix_step_independent_of_the_gradient_scale(make) -> None:
    """The step of a weight matrix is a fraction of its norm, whatever the loss scale (the
    point of layer-wise adaptation); a plain SGD step would grow 1000x."""
    small, large = _model(), _model()
    _train(small, make(small.parameters()), steps=1)
    _train(large, make(large.parameters()), steps=1, scale=1000.0)
    start = _model()
    for a, b, w in zip(small.parameters(), large.parameters(), start.parameters(), strict=True):
        if w.dim() > 1:
            torch.testing.assert_close(a - w, b - w, atol=1e-5, rtol=1e-3)


def test_one_dimensional_tensors_are_not_adapted_or_decayed_unless_asked() -> None:
    model = _model()
    frozen = copy.deepcopy(model)
    for p in frozen.parameters():
        p.requires_grad_(p.dim() <= 1)
    sgd = torch.optim.SGD([p for p in frozen.parameters() if p.dim() <= 1], lr=0.5, momentum=0.9)
    lars_model = copy.deepcopy(model)
    for p in lars_model.parameters():
        p.requires_grad_(p.dim() <= 1)
    lars = Lars([p for p in lars_model.parameters() if p.dim() <= 1], lr=0.5, weight_decay=0.1)
    _train(frozen, sgd)
    _train(lars_model, lars)
    for a, b in zip(frozen.parameters(), lars_model.parameters(), strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda ps: Lars(ps, lr=0.0), "Lars lr=0.0"),
        (lambda ps: Lars(ps, lr=1.0, momentum=1.0), "Lars momentum=1.0"),
        (lambda ps: Lars(ps, lr=1.0, trust_coefficient=0), "trust_coefficient=0"),
        (lambda ps: Lamb(ps, lr=1.0, betas=(0.9, 1.0)), r"Lamb betas=\(0.9, 1.0\)"),
        (lambda ps: Lamb(ps, lr=1.0, weight_decay=-1), "Lamb weight_decay=-1"),
    ],
)
def test_bad_settings_are_refused(make, match) -> None:
    with pytest.raises(ConfigError, match=match):
        make(_model().parameters())
