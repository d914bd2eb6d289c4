"""LAMB: Adam's direction with a per-tensor trust ratio (You et al. 2019, Algorithm 2)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from syncline.optim._common import ForeachOptimizer, check, trust_ratio


class Lamb(ForeachOptimizer):
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

    def _step_tensors(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        """One step of ``params`` (one device and dtype, all with a gradient): a few
        ``torch._foreach_*`` kernels for all of them, the trust ratios decided on the device
        (``torch.where`` on the stacked norms), so no host sync; per tensor, bit for bit the
        arithmetic of a loop over the tensors."""
        beta1, beta2 = group["betas"]
        grads = [p.grad for p in params if p.grad is not None]  # all of them (with_grads)
        steps = []
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] += 1
            steps.append(state["step"])
        ms = [self.state[p]["exp_avg"] for p in params]
        vs = [self.state[p]["exp_avg_sq"] for p in params]
        torch._foreach_mul_(ms, beta1)
        torch._foreach_add_(ms, grads, alpha=1 - beta1)
        torch._foreach_mul_(vs, beta2)
        torch._foreach_addcmul_(vs, grads, grads, value=1 - beta2)
        denom = torch._foreach_div(vs, [1 - beta2**t for t in steps])
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, group["eps"])
        updates = torch._foreach_div(ms, [1 - beta1**t for t in steps])
        torch._foreach_div_(updates, denom)
        del denom
        adapt = [i for i, p in enumerate(params) if p.dim() > 1 or group["adapt_1d"]]
        if adapt:
            weights, adapted = [params[i] for i in adapt], [updates[i] for i in adapt]
            if group["weight_decay"]:
                torch._foreach_add_(adapted, weights, alpha=group["weight_decay"])
            w_norms = torch.stack(torch._foreach_norm(weights)).clamp(max=group["clamp"])
            u_norms = torch.stack(torch._foreach_norm(adapted))
            torch._foreach_mul_(adapted, list(trust_ratio(w_norms, u_norms).unbind()))
        torch._foreach_add_(params, updates, alpha=-group["lr"])
