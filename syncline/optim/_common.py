"""What LARS and LAMB share: range checks, the closure, and the per-tensor trust ratio."""

from __future__ import annotations

from collections.abc import Callable, Mapping
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
