"""Mixed precision: autocast, and fp16 loss scaling whose verdict every rank agrees on.

``bf16`` and ``fp16`` run the forward and the loss under ``torch.autocast`` (matrix products
in half width); the parameters, their gradients and the optimizer state stay fp32 (the
master weights of Micikevicius et al. 2018). bf16 has fp32's range and needs nothing more.
fp16's range is small (largest 65504, smallest normal 6e-5), so the loss is multiplied by a
scale before backward, and the gradients divided by it before the step (dynamic loss
scaling): halved after a step whose gradients overflowed (that step is skipped), doubled
after ``growth_interval`` clean steps.

**Every rank skips the same steps.** A rank alone cannot decide: with a sparse compressor
(CSC, TopK) an inf on one rank may not reach the others, and a rank that steps while its
peer skips leaves the replicas different for the rest of the run, with no error. So each
rank's own verdict (any non-finite gradient) is summed over all ranks in one 1-element
allreduce, and all skip if any overflowed; the scale therefore moves identically everywhere,
and is checkpointed with the run. A pipeline agrees over its stages and their replicas: the
sum over the pipeline's group, then over the replicas' group, is the sum over every rank of
the grid (:mod:`syncline.pipeline.precision`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from syncline import comm
from syncline.dp.config import PRECISIONS
from syncline.errors import ConfigError

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@contextlib.contextmanager
def autocast(precision: str, device: torch.device) -> Iterator[None]:
    """The forward (and loss) of one step under ``precision``; fp32 changes nothing."""
    if precision not in PRECISIONS:
        raise ConfigError(f"precision={precision!r} is unknown; valid: {', '.join(PRECISIONS)}")
    if precision == "fp32":
        yield
        return
    with torch.autocast(device.type, dtype=_DTYPES[precision]):
        yield


class LossScaler:
    """Dynamic fp16 loss scaling whose overflow verdict every rank shares (see the module
    docstring).

    Args:
        init_scale: the first scale (2**16, as torch's GradScaler).
        growth_interval: clean steps after which the scale doubles.
        timeout_s: the longest the agreement may wait for another rank.
        groups: the groups whose ranks must agree, summed one after another (default: the
            default group; a pipeline: its own group, then its replicas').

    Example:
        >>> scaler = LossScaler()
        >>> scaler.scale(loss).backward()          # DataParallel averages scaled gradients
        >>> if scaler.unscale_or_skip(params, step):
        ...     opt.step()
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_interval: int = 2000,
        timeout_s: float = 300.0,
        groups: Sequence[comm.Group] = (None,),
    ) -> None:
        if not init_scale > 0 or isinstance(growth_interval, bool) or growth_interval < 1:
            raise ConfigError(
                f"LossScaler(init_scale={init_scale!r}, growth_interval={growth_interval!r}); "
                "valid: a scale > 0 and an interval >= 1"
            )
        self.value = float(init_scale)
        self.growth_interval = int(growth_interval)
        self._clean = 0
        self._timeout_s = timeout_s
        self._groups = tuple(groups)
        self.skipped = 0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.value

    def unscale_or_skip(
        self,
        params: Iterable[torch.nn.Parameter],
        step: int,
        *,
        unscaled: bool = False,
        overflowed: bool = False,
    ) -> bool:
        """Divide the gradients by the scale and return ``True``; or, if any rank's gradients
        overflowed, leave them, halve the scale and return ``False`` (skip this step) on
        every rank alike. ``unscaled``: the gradients were divided already (by the engine,
        before a compressor with a residual); ``overflowed``: this rank saw an inf there."""
        grads = [p.grad for p in params if p.grad is not None]
        found = self.overflowed(grads, f"loss-scale overflow verdict at step {step}", overflowed)
        if not found and not unscaled:
            self.unscale_(grads, self.value)
        self.update(found)
        return not found

    def overflowed(self, grads: Sequence[torch.Tensor], what: str, local: bool = False) -> bool:
        """Whether any rank of the groups holds a non-finite gradient (or says ``local``);
        one 1-element allreduce per group, every rank must call it at the same point."""
        local = local or any(not bool(torch.isfinite(g).all()) for g in grads)
        flag = torch.tensor([1.0 if local else 0.0])
        device = grads[0].device if grads else torch.device("cpu")
        for group in self._groups:
            reduce = comm.FlatAllreduce(group, timeout_s=self._timeout_s)
            if reduce.world_size > 1:
                shared = flag.to(device)
                reduce.allreduce(shared, what).wait()
                flag = shared.cpu()
        return float(flag) > 0

    @staticmethod
    def unscale_(grads: Iterable[torch.Tensor], scale: float) -> None:
        """Divide ``grads`` by ``scale`` in place (a power of two: exact)."""
        inverse = 1.0 / scale
        for g in grads:
            g.mul_(inverse)

    def update(self, found: bool) -> None:
        """After a verdict: halve the scale on an overflow (the step is skipped), double it
        after ``growth_interval`` clean steps."""
        if found:
            self.value /= 2.0
            self._clean = 0
            self.skipped += 1
            return
        self._clean += 1
        if self._clean == self.growth_interval:
            self.value *= 2.0
            self._clean = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.value, "clean": self._clean, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["scale"])
        self._clean = int(state["clean"])
        self.skipped = int(state.get("skipped", 0))


def unscale_and_flag(
    bucket: torch.Tensor, inverse: float, flag: torch.Tensor | None
) -> torch.Tensor:
    """Multiply ``bucket`` by ``inverse`` (one over the loss scale) in place and replace any
    inf or NaN (an fp16 overflow) by 0, so that a compressor with a residual never keeps one;
    return ``flag`` or-ed with whether there was one. The flag stays a tensor (no host sync)
    until the step's verdict reads it."""
    bucket.mul_(inverse)
    bad = torch.isfinite(bucket).all().logical_not()
    torch.nan_to_num_(bucket, nan=0.0, posinf=0.0, neginf=0.0)
    return bad if flag is None else flag.logical_or(bad)


def scaler_summary(scaler: LossScaler | None) -> dict[str, Any]:
    """What a run summary says of fp16's scale: its last value and the steps it skipped."""
    if scaler is None:
        return {}
    return {"loss_scale": scaler.value, "skipped_steps": scaler.skipped}
