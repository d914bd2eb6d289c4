"""LAMB: Adam's direction with a per-tensor trust ratio (You et al. 2019, Algorithm 2)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from syncline.optim._common import check, closure_loss, trust_ratio


class Lamb(torch.optim.Optimizer):
    """Layer-wise Adaptive Moments for Batch training.

    For each parameter tensor ``w`` with gradient ``g`` at step ``t`` (You et al. 2019,
    Algorithm 2, with Adam's bias correction)::

        m = beta1 * m + (1 - beta1) * g          v = beta2 * v + (1 - beta2) * g^2
        u = (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps) + weight_decay * w
        ratio = min(||w||, clamp) / ||u||        (1 if either norm is 0)
        w = w - lr * ratio * u

    ``clamp`` is the paper's scaling function phi, bounding the weight norm (10, as common
    implementations use). Tensors with fewer than two dimensions (biases, normalisation
    scales) get Adam's step without the ratio or the decay unless ``adapt_1d``.

    Args:
        params: parameters or parameter groups.
        lr: the global learning rate (scaled with the batch, warmed up), > 0.
        betas: Adam's (beta1, beta2), each in [0, 1).
        eps: > 0.
        weight_decay: >= 0 (decoupled, inside the ratio as in the paper).
        clamp: upper bound of the weight norm in the ratio, > 0.
        adapt_1d: also adapt (and decay) tensors with fewer than two dimensions.

    Raises:
        ConfigError: a value out of its range, naming it.

    Example:
        >>> opt = Lamb(model.parameters(), lr=2e-3, weight_decay=0.01)
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        clamp: float = 10.0,
        adapt_1d: bool = False,
    ) -> None:
        checks: dict[str, tuple[Any, bool]] = {
            "lr": (lr, lr > 0),
            "betas": (betas, all(0 <= b < 1 for b in betas) and len(betas) == 2),
            "eps": (eps, eps > 0),
            "weight_decay": (weight_decay, weight_decay >= 0),
            "clamp": (clamp, clamp > 0),
        }
        check("Lamb", checks)
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "clamp": clamp,
            "adapt_1d": adapt_1d,
        }
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure_loss(closure)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lamb does not take sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                t = state["step"]
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                denom = (v / (1 - beta2**t)).sqrt_().add_(group["eps"])
                update = (m / (1 - beta1**t)).div_(denom)
                if p.dim() > 1 or group["adapt_1d"]:
                    if group["weight_decay"]:
                        update.add_(p, alpha=group["weight_decay"])
                    w_norm = torch.linalg.vector_norm(p).clamp(max=group["clamp"])
                    u_norm = torch.linalg.vector_norm(update)
                    ratio = trust_ratio(w_norm, u_norm)
                    update.mul_(ratio)
                p.add_(update, alpha=-group["lr"])
        return loss
