"""LARS: SGD with momentum and a per-tensor trust ratio (You, Gitman, Ginsburg 2017, Alg. 1)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from syncline.optim._common import ForeachOptimizer, check, trust_ratio


class Lars(ForeachOptimizer):
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

    def _step_tensors(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        """One step of ``params`` (one device and dtype, all with a gradient): a few
        ``torch._foreach_*`` kernels for all of them, the trust ratios decided on the device
        (``torch.where`` on the stacked norms), so no host sync; per tensor, bit for bit the
        arithmetic of a loop over the tensors. The gradients themselves are never written."""
        steps = [p.grad for p in params if p.grad is not None]  # all of them (with_grads)
        adapt = [i for i, p in enumerate(params) if p.dim() > 1 or group["adapt_1d"]]
        if adapt:
            weights, grads = [params[i] for i in adapt], [steps[i] for i in adapt]
            if group["weight_decay"]:
                grads = list(torch._foreach_add(grads, weights, alpha=group["weight_decay"]))
            w_norms = torch.stack(torch._foreach_norm(weights))
            g_norms = torch.stack(torch._foreach_norm(grads))
            eta = group["trust_coefficient"]
            ratios = trust_ratio(eta * w_norms, g_norms + group["eps"] * (g_norms > 0))
            for i, g in zip(adapt, torch._foreach_mul(grads, list(ratios.unbind())), strict=True):
                steps[i] = g
        if group["momentum"]:
            old, new = [], []
            for i, p in enumerate(params):
                state = self.state[p]
                buf = state.get("momentum_buffer")
                if buf is None:
                    state["momentum_buffer"] = steps[i].detach().clone()
                else:
                    old.append(buf)
                    new.append(steps[i])
                steps[i] = state["momentum_buffer"]
            if old:
                torch._foreach_mul_(old, group["momentum"])
                torch._foreach_add_(old, new)
        torch._foreach_add_(params, steps, alpha=-group["lr"])
