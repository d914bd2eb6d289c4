"""Mixed precision in a pipeline: every stage's forward under autocast, and fp16 loss scaling
whose skip verdict every stage and every replica shares.

bf16 needs nothing but autocast: each stage runs its forward (and a recompute, and the loss
on the last stage) under ``torch.autocast``; the weights, their gradients and the optimizer
state stay fp32, and whatever dtype a stage hands on travels as it is (the first message of
a shape carries its dtype).

fp16 scales the loss, so it needs three things to hold on every rank:

- **one scale per batch.** Only the last stage multiplies (its micro-batch losses, before
  backward); every other stage receives gradients already scaled, and divides its
  parameters' gradients by the same scale at its STEP. The scale of batch ``b`` is the one
  left by the verdicts of batches ``< b``: every rank takes verdicts in batch order, so
  every rank knows it. The last stage checks that it has taken batch ``b - 1``'s verdict
  before it backpropagates batch ``b`` (a schedule that overlapped them would need the
  scale before it is known; it is refused with an error rather than mis-scaled).
- **one verdict per batch, shared.** At this rank's first STEP of a batch, the gradients of
  all of its stages are checked for inf/NaN and the flags are summed over the pipeline's
  group, then over the replicas' group (:class:`syncline.dp.precision.LossScaler`): the sum
  over every rank of the grid. So every stage of every replica skips the same batch, and
  the scale moves alike everywhere. Under 2BW a skipped STEP still makes its version (a
  copy of the newest, unchanged), so the versions stay numbered as the schedule expects.
- **gradients unscaled before the optimizer**, after the REDUCE (a linear average, scaled
  or not) and after tied copies are summed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

import torch

from syncline import comm
from syncline.dp.compression import Compressor
from syncline.dp.precision import LossScaler, autocast
from syncline.errors import ConfigError

__all__ = ["PipelinePrecision"]


class PipelinePrecision:
    """Autocast and the fp16 scale of one :class:`~syncline.pipeline.runtime.Pipeline`.

    Args:
        precision: ``fp32``, ``bf16`` or ``fp16``.
        groups: the pipeline's group, then the replicas' (if any): the verdict's reach.
        timeout_s: the longest the verdict may wait for another rank.
        device: where the stages run (autocast's device type).
        compression: the replicas' REDUCE compressor, if any. fp16 refuses one with error
            feedback: a skipped step would leave inf in its residual.
    """

    def __init__(
        self,
        precision: str,
        groups: Sequence[comm.Group],
        timeout_s: float,
        device: torch.device,
        compression: Compressor | None = None,
    ) -> None:
        if precision == "fp16" and compression is not None and not compression.stateless:
            raise ConfigError(
                f"precision='fp16' with compression={compression!r} is not supported: an "
                "overflowed (skipped) step would leave inf in the compressor's residual; "
                "valid: precision='bf16' (no loss scaling), or a stateless compressor "
                "(none, FP16, BF16)"
            )
        self.precision = precision
        self._device = device
        self.scaler = (
            LossScaler(timeout_s=timeout_s, groups=groups) if precision == "fp16" else None
        )
        self._verdict: tuple[int, float] | None = None  # last batch judged, its scale (0: skip)
        self._next_verdict: int | None = None  # the batch whose verdict comes next

    def autocast(self) -> AbstractContextManager[None]:
        return autocast(self.precision, self._device)

    def loss_scale(self, batch: int) -> float:
        """The factor the last stage multiplies batch ``batch``'s losses by (1: no scaling)."""
        if self.scaler is None:
            return 1.0
        if self._next_verdict is None:
            self._next_verdict = batch
        if batch != self._next_verdict:
            raise RuntimeError(
                f"precision='fp16': the last stage backpropagates batch {batch} before the "
                f"loss-scale verdict of batch {batch - 1}; this schedule overlaps them, which "
                "fp16 loss scaling does not support (use bf16)"
            )
        return self.scaler.value

    def before_step(
        self, batch: int, grads: list[torch.Tensor], local: Callable[[], list[torch.Tensor]]
    ) -> bool:
        """At a STEP of ``batch`` on this rank, its stage's gradients ``grads`` in hand:
        unscale them and return ``True``, or return ``False`` (skip) on an overflow. The
        first STEP of a batch takes the verdict over ``local()`` (every stage's gradients on
        this rank) with every other rank."""
        if self.scaler is None:
            return True
        if self._verdict is None or self._verdict[0] != batch:
            if self._next_verdict is not None and batch != self._next_verdict:
                raise RuntimeError(
                    f"precision='fp16': verdict of batch {batch} taken out of order (next "
                    f"expected: {self._next_verdict})"
                )
            value = self.scaler.value
            found = self.scaler.overflowed(local(), f"loss-scale overflow verdict of step {batch}")
            self._verdict = (batch, 0.0 if found else value)
            self.scaler.update(found)
            self._next_verdict = batch + 1
        elif any(not bool(torch.isfinite(g).all()) for g in grads):
            raise RuntimeError(  # a later stage of this rank overflowed after the verdict
                f"precision='fp16': a stage's gradient of batch {batch} is not finite, but "
                "the batch's verdict (taken at this rank's first STEP) found none"
            )
        scale = self._verdict[1]
        if scale == 0.0:
            return False
        self.scaler.unscale_(grads, scale)
        return True
