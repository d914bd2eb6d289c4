"""An optimizer step the device may cancel: ``step_unless(opt, flag)`` with no host read.

The non-finite guard (:mod:`syncline.dp.guard`) decides on the device whether a step's
update is dropped; reading that verdict on the host before every ``opt.step()`` would stall
a GPU each step. Two ways to drop an update on the device:

- **Fused optimizers** (torch's SGD, Adam and AdamW with ``fused=True``, on CPU and CUDA)
  take a ``found_inf`` tensor the way ``torch.amp.GradScaler`` hands it to them (it sets
  ``optimizer.found_inf`` when ``_step_supports_amp_scaling`` is true): the fused kernel
  leaves parameters and moments as they are where it is nonzero, and Adam subtracts it from
  its step counters again. Used once the optimizer has state for every parameter: the fused
  SGD's first step would leave its momentum buffers uninitialised (``empty_like``) if
  cancelled.
- **Any other optimizer** (syncline's LARS, torch's foreach ones, a first fused step): a
  masked update. Parameters and tensor state are copied before the step, and each is put
  back with ``torch.where(flag, old, new)`` after it; state the step created is reset to
  zeros (the initial value of every momentum and moment in torch, LARS and LAMB). State
  that is not a tensor (LAMB's ``int`` step) cannot follow a device flag: refused.

The copy costs one read and write of the parameters and the state per step; ``fused=True``
costs nothing extra.
"""

from __future__ import annotations

from typing import Any

import torch

from syncline.errors import ConfigError

__all__ = ["fused_capable", "step_unless"]


def fused_capable(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt`` skips on a ``found_inf`` tensor itself (a fused torch optimizer)."""
    return bool(getattr(opt, "_step_supports_amp_scaling", False)) and all(
        g.get("fused") for g in opt.param_groups
    )


def _params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"] if p.grad is not None]


def step_unless(opt: torch.optim.Optimizer, flag: torch.Tensor) -> None:
    """``opt.step()``, whose update is dropped where the 0-d device tensor ``flag`` is
    nonzero: parameters and optimizer state as if the step had not been taken.

    Raises:
        ConfigError: the optimizer keeps state that is not a tensor and that the step
            changed (it cannot be restored on the device).
    """
    params = _params(opt)
    if fused_capable(opt) and all(p in opt.state and opt.state[p] for p in params):
        opt.found_inf = flag.float()  # type: ignore[attr-defined]  # as GradScaler sets it
        try:
            opt.step()
        finally:
            del opt.found_inf  # type: ignore[attr-defined]
        return
    old_params = [p.detach().clone() for p in params]
    old_state = {p: _tensor_state(opt, p, clone=True) for p in params}
    plain = {p: _plain_state(opt, p) for p in params}
    opt.step()
    keep = flag != 0
    with torch.no_grad():
        for p, old in zip(params, old_params, strict=True):
            p.copy_(torch.where(keep, old, p))
        for p in params:
            before = old_state[p]
            for key, now in _tensor_state(opt, p, clone=False).items():
                was = before.get(key)
                now.copy_(torch.where(keep, torch.zeros_like(now) if was is None else was, now))
            if _plain_state(opt, p) != plain[p]:
                raise ConfigError(
                    f"{type(opt).__name__} keeps non-tensor state that changes each step "
                    f"({sorted(_plain_state(opt, p))}), which a step skipped on the device "
                    "cannot restore; valid with the non-finite guard: an optimizer whose state "
                    "is tensors (adamw, sgd, lars)"
                )


def _tensor_state(opt: torch.optim.Optimizer, p: torch.Tensor, *, clone: bool) -> dict[str, Any]:
    state = opt.state.get(p, {})
    return {
        k: (v.detach().clone() if clone else v)
        for k, v in state.items()
        if isinstance(v, torch.Tensor)
    }


def _plain_state(opt: torch.optim.Optimizer, p: torch.Tensor) -> dict[str, Any]:
    state = opt.state.get(p, {})
    return {
        k: v for k, v in state.items() if isinstance(v, int | float) and not isinstance(v, bool)
    }
