"""What LARS and LAMB share: range checks, the closure, the per-tensor trust ratio, and the
grouping of a step's tensors for ``torch._foreach_*`` (a few kernels per group, not per
tensor; no host sync: the norms and ratios stay on the device)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from syncline.errors import ConfigError


def check(owner: str, checks: Mapping[str, tuple[Any, bool]]) -> None:
    """Raise naming the first ``name=value`` whose check is false."""
    for name, (value, ok) in checks.items():
        if not ok:
            raise ConfigError(f"{owner} {name}={value!r} is out of range (see its docstring)")


def closure_loss(closure: Callable[[], float] | None) -> float | None:
    """The optimizer protocol's closure, evaluated with gradients on."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def trust_ratio(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """``numerator / denominator``, or 1 where either is 0 (a fresh or a gradient-free tensor)."""
    ok = (numerator > 0) & (denominator > 0)
    return torch.where(ok, numerator / denominator, torch.ones_like(numerator))


def with_grads(
    owner: str, params: Iterable[torch.Tensor]
) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    """The parameters that have a gradient, by ``(device, dtype)`` (``torch._foreach_*``
    takes one device and dtype per call), in their order; sparse gradients are refused.

    Raises:
        RuntimeError: a parameter has a sparse gradient.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in params:
        if p.grad is None:
            continue
        if p.grad.is_sparse:
            raise RuntimeError(f"{owner} does not take sparse gradients")
        groups.setdefault((p.device, p.dtype), []).append(p)
    return groups


class ForeachOptimizer(torch.optim.Optimizer):
    """An optimizer whose step runs per group of tensors on one device and dtype: the
    subclass's ``_step_tensors(group, params)`` takes each such group (all with a gradient,
    none sparse) and updates it with a few ``torch._foreach_*`` kernels."""

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure_loss(closure)
        for group in self.param_groups:
            for params in with_grads(type(self).__name__, group["params"]).values():
                self._step_tensors(group, params)
        return loss

    def _step_tensors(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        raise NotImplementedError
