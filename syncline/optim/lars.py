"""LARS: SGD with momentum and a per-tensor trust ratio (You, Gitman, Ginsburg 2017, Alg. 1)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from syncline.optim._common import check, closure_loss, trust_ratio


class Lars(torch.optim.Optimizer):
    """Layer-wise Adaptive Rate Scaling.

    For each parameter tensor ``w`` with gradient ``g`` (You et al. 2017, Algorithm 1)::

        g'    = g + weight_decay * w
        ratio = trust_coefficient * ||w|| / (||g'|| + eps)     (1 if ||w|| or ||g'|| is 0)
        v     = momentum * v + ratio * g'
        w     = w - lr * v

    Tensors of one dimension or none (biases, normalisation scales) are left out of the
    adaptation and the weight decay, as in the paper's ImageNet runs and Goyal et al.: their
    norm says little about a step size, and decaying them hurts. ``adapt_1d=True`` includes
    them.

    Args:
        params: parameters or parameter groups.
        lr: the global learning rate (scaled with the batch, warmed up).
        momentum: in [0, 1).
        weight_decay: >= 0, added to the gradient before the ratio.
        trust_coefficient: eta in the paper, > 0 (0.001 for ImageNet).
        eps: added to the gradient norm, >= 0.
        adapt_1d: also adapt (and decay) tensors with fewer than two dimensions.

    Raises:
        ConfigError: a value out of its range, naming it.

    Example:
        >>> opt = Lars(model.parameters(), lr=8.0, momentum=0.9, weight_decay=5e-4)
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        trust_coefficient: float = 0.001,
        eps: float = 1e-8,
        adapt_1d: bool = False,
    ) -> None:
        checks: dict[str, tuple[Any, bool]] = {
            "lr": (lr, lr > 0),
            "momentum": (momentum, 0 <= momentum < 1),
            "weight_decay": (weight_decay, weight_decay >= 0),
            "trust_coefficient": (trust_coefficient, trust_coefficient > 0),
            "eps": (eps, eps >= 0),
        }
        check("Lars", checks)
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "weight_decay": weight_decay,
            "trust_coefficient": trust_coefficient,
            "eps": eps,
            "adapt_1d": adapt_1d,
        }
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure_loss(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lars does not take sparse gradients")
                g = p.grad
                if p.dim() > 1 or group["adapt_1d"]:
                    if group["weight_decay"]:
                        g = g.add(p, alpha=group["weight_decay"])
                    w_norm, g_norm = torch.linalg.vector_norm(p), torch.linalg.vector_norm(g)
                    eta = group["trust_coefficient"]
                    ratio = trust_ratio(eta * w_norm, g_norm + group["eps"] * (g_norm > 0))
                    g = g * ratio
                if group["momentum"]:
                    state = self.state[p]
                    buf = state.get("momentum_buffer")
                    if buf is None:
                        buf = state["momentum_buffer"] = g.detach().clone()
                    else:
                        buf.mul_(group["momentum"]).add_(g)
                    g = buf
                p.add_(g, alpha=-group["lr"])
        return loss
