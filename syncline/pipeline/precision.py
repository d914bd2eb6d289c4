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

A REDUCE with an error-feedback compressor (CSC, TopK, PowerSGD) keeps a residual across
steps, so it must never see a scaled or non-finite gradient: a skipped step would leave inf
in the residual, and a residual kept at one step's scale would be wrong at the next. There
each bucket is unscaled as it enters the compressor (:meth:`PipelinePrecision.unscale_bucket`,
with batch ``b``'s scale), its infs and NaNs zeroed and flagged; the flag joins this rank's
share of the verdict, and the STEP does not unscale again. This is what data parallelism
does (:meth:`syncline.dp.DataParallel.unscale_in_reduce`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

import torch

from syncline import comm
from syncline.dp.compression import Compressor
from syncline.dp.precision import LossScaler, autocast, non_finite_into, unscale_and_flag

__all__ = ["PipelinePrecision"]


class PipelinePrecision:
    """Autocast and the fp16 scale of one :class:`~syncline.pipeline.runtime.Pipeline`.

    Args:
        precision: ``fp32``, ``bf16`` or ``fp16``.
        groups: the pipeline's group, then the replicas' (if any): the verdict's reach.
        timeout_s: the longest the verdict may wait for another rank.
        device: where the stages run (autocast's device type).
        compression: the replicas' REDUCE compressor, if any. Under fp16 one with error
            feedback gets its buckets unscaled (see the module docstring).
    """

    def __init__(
        self,
        precision: str,
        groups: Sequence[comm.Group],
        timeout_s: float,
        device: torch.device,
        compression: Compressor | None = None,
    ) -> None:
        self.precision = precision
        #: buckets are unscaled as they enter the REDUCE's compressor (it keeps a residual)
        self.in_reduce = (
            precision == "fp16" and compression is not None and not compression.stateless
        )
        self._flags: dict[int, torch.Tensor] = {}  # per batch: a REDUCE bucket held inf/NaN
        self._device = device
        self.scaler = (
            LossScaler(timeout_s=timeout_s, groups=groups) if precision == "fp16" else None
        )
        self._verdict: tuple[int, float] | None = None  # last batch judged, its scale (0: skip)
        self._judged_at = 1.0  # the scale the last batch judged was trained at
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

    def unscale_bucket(self, batch: int, bucket: torch.Tensor) -> None:
        """Before the REDUCE's compressor takes ``bucket`` (batch ``batch``): divide it by the
        batch's scale, zero any inf or NaN and note it for the batch's verdict. No host sync:
        the flag stays a tensor until the verdict reads it."""
        assert self.scaler is not None and self.in_reduce
        if self._verdict is not None and self._verdict[0] == batch:
            scale = self._judged_at  # a stage reduced after this rank's first STEP of batch
        elif self._next_verdict is None or self._next_verdict == batch:
            scale = self.scaler.value
        else:
            raise RuntimeError(
                f"precision='fp16': REDUCE of batch {batch} before the loss-scale verdict of "
                f"batch {self._next_verdict}; its scale is not known yet"
            )
        self._flags[batch] = unscale_and_flag(bucket, 1.0 / scale, self._flags.get(batch))

    def _flag(self, batch: int) -> torch.Tensor | bool:
        """The REDUCE's inf/NaN flag of ``batch`` on the device (``False``: none kept)."""
        flag = self._flags.get(batch)
        return False if flag is None else flag

    def _late_overflow(self, batch: int, grads: list[torch.Tensor]) -> bool:
        """Whether a STEP after the batch's verdict (another stage of this rank, interleaved)
        holds an inf/NaN the verdict did not see: one fused check, one host read."""
        flag = torch.zeros(1, dtype=torch.float32, device=self._device)
        non_finite_into(grads, flag)
        late = self._flags.get(batch)
        if late is not None:
            flag.add_(late.to(device=flag.device, dtype=flag.dtype).reshape(1))
        return bool(flag.item() > 0)

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
            found = self.scaler.overflowed(  # the step's one host read
                local(), f"loss-scale overflow verdict of step {batch}", self._flag(batch)
            )
            self._verdict, self._judged_at = (batch, 0.0 if found else value), value
            self.scaler.update(found)
            self._next_verdict = batch + 1
            for old in [b for b in self._flags if b < batch]:
                del self._flags[old]
        elif self._verdict[1] != 0.0 and self._late_overflow(batch, grads):
            raise RuntimeError(  # a later stage of this rank overflowed after the verdict
                f"precision='fp16': a stage's gradient of batch {batch} is not finite, but "
                "the batch's verdict (taken at this rank's first STEP) found none"
            )
        scale = self._verdict[1]
        if scale == 0.0:
            return False
        if not self.in_reduce:  # else its REDUCE unscaled it already
            self.scaler.unscale_(grads, scale)
        return True
