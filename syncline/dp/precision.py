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
and is checkpointed with the run. The verdict is one flag tensor on the gradients' device,
set by one fused check per device (and by the buckets an error-feedback compressor saw,
:func:`unscale_and_flag`), summed on the device and read on the host once per step: the
one host sync of an fp16 step, where the host decides whether to step. A pipeline agrees
over its stages and their replicas: the sum over the pipeline's group, then over the
replicas' group, is the sum over every rank of the grid (:mod:`syncline.pipeline.precision`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from syncline import comm
from syncline.comm.device import comm_device
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
        overflowed: bool | torch.Tensor | None = False,
    ) -> bool:
        """Divide the gradients by the scale and return ``True``; or, if any rank's gradients
        overflowed, halve the scale and return ``False`` (skip this step) on every rank
        alike. ``unscaled``: the gradients were divided already (by the engine, before a
        compressor with a residual); ``overflowed``: this rank saw an inf there (a bool, or
        better the device flag of :func:`unscale_and_flag`, which costs no host read).

        One host read per step, of the agreed verdict (whether to step is decided on the
        host); everything before it runs on the device. The check and the division are one
        pass (:func:`torch._amp_foreach_non_finite_check_and_unscale_`, as torch's
        ``GradScaler``), so on a skipped step the gradients are divided too (they are not
        used: the step is skipped).
        """
        grads = [p.grad for p in params if p.grad is not None]
        what = f"loss-scale overflow verdict at step {step}"
        inverse = None if unscaled else 1.0 / self.value
        found = self._read(self.overflow_flag(grads, what, overflowed, inverse=inverse))
        self.update(found)
        return not found

    def overflowed(
        self, grads: Sequence[torch.Tensor], what: str, local: bool | torch.Tensor | None = False
    ) -> bool:
        """Whether any rank of the groups holds a non-finite gradient (or says ``local``):
        :meth:`overflow_flag`, read on the host (the step's one read)."""
        return self._read(self.overflow_flag(grads, what, local))

    @staticmethod
    def _read(flag: torch.Tensor) -> bool:
        return bool(flag.item() > 0)  # the one host read of the step: whether to step

    def overflow_flag(
        self,
        grads: Sequence[torch.Tensor],
        what: str,
        local: bool | torch.Tensor | None = False,
        *,
        inverse: float | None = None,
    ) -> torch.Tensor:
        """The verdict as one flag on the gradients' device, ``> 0`` when any rank of the
        groups holds a non-finite gradient (or ``local`` says so: a bool, or a flag tensor
        of :func:`unscale_and_flag`); one 1-element allreduce per group, which every rank
        must enter at the same point. No host sync: the caller reads the flag once.

        ``inverse``: also multiply the gradients by it, in the same pass as the check.
        """
        device = grads[0].device if grads else _flag_device(local)
        flag = torch.zeros(1, dtype=torch.float32, device=device)
        non_finite_into(grads, flag, inverse)
        if isinstance(local, torch.Tensor):
            flag.add_(local.to(device=device, dtype=flag.dtype).reshape(1))
        elif local:
            flag.fill_(1.0)
        for group in self._groups:
            reduce = comm.FlatAllreduce(group, timeout_s=self._timeout_s)
            if reduce.world_size > 1:
                # on the gradients' device (gloo also sums CUDA tensors); a CPU flag (no
                # gradients here) goes where the backend takes it (NCCL: this rank's GPU)
                wire = flag.device
                if wire.type == "cpu":
                    wire = comm_device(comm.backend_name(group), wire)
                shared = flag if wire == flag.device else flag.to(wire)
                reduce.allreduce(shared, what).wait()
                if shared is not flag:
                    flag.copy_(shared)
        return flag

    @staticmethod
    def unscale_(grads: Iterable[torch.Tensor], scale: float) -> None:
        """Divide ``grads`` by ``scale`` in place (a power of two: exact), in one
        ``torch._foreach_mul_`` (bit for bit a ``mul_`` per tensor)."""
        grads = list(grads)
        if grads:
            torch._foreach_mul_(grads, 1.0 / scale)

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


def _flag_device(local: bool | torch.Tensor | None) -> torch.device:
    return local.device if isinstance(local, torch.Tensor) else torch.device("cpu")


def non_finite_into(
    grads: Sequence[torch.Tensor], flag: torch.Tensor, inverse: float | None = None
) -> None:
    """Set ``flag`` (1 element, float32) to 1 where any of ``grads`` holds an inf or NaN,
    on the device, without resetting it; multiply the dense ones by ``inverse`` if given.

    One fused pass per device (``torch._amp_foreach_non_finite_check_and_unscale_``)
    instead of one ``isfinite().all()`` and one host read per tensor. It judges the values
    before the multiplication, which with ``inverse <= 1`` (a loss scale ``>= 1``) is the
    same verdict; a larger ``inverse`` multiplies first and judges the product. Sparse
    gradients are judged on their values and divided one by one.
    """
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        if g.is_sparse:
            bad = torch.isfinite(g._values()).all().logical_not()
            flag.add_(bad.to(device=flag.device, dtype=flag.dtype))
            if inverse is not None:
                g.mul_(inverse)
        else:
            by_device.setdefault(g.device, []).append(g)
    for device, group in by_device.items():
        scale = 1.0 if inverse is None else inverse
        if scale > 1.0:  # the product may overflow: judge it, not the input
            torch._foreach_mul_(group, scale)
            scale = 1.0
        found = flag if device == flag.device else torch.zeros_like(flag, device=device)
        inv = torch.full((1,), scale, dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(group, found, inv)
        if found is not flag:
            flag.add_(found.to(flag.device))


def unscale_and_flag(
    bucket: torch.Tensor, inverse: float, flag: torch.Tensor | None
) -> torch.Tensor:
    """Multiply ``bucket`` by ``inverse`` (one over the loss scale) in place and replace any
    inf or NaN (an fp16 overflow) by 0, so that a compressor with a residual never keeps one;
    return ``flag`` (a 1-element float32 tensor on the bucket's device, made on the first
    call) set to 1 if there was one. The flag stays on the device (no host sync) and
    accumulates the step's buckets in place, until the step's verdict reads it once
    (:meth:`LossScaler.overflow_flag` takes it as ``local``)."""
    if flag is None:
        flag = torch.zeros(1, dtype=torch.float32, device=bucket.device)
    non_finite_into([bucket], flag, inverse)
    torch.nan_to_num_(bucket, nan=0.0, posinf=0.0, neginf=0.0)
    return flag


def scaler_summary(scaler: LossScaler | None) -> dict[str, Any]:
    """What a run summary says of fp16's scale: its last value and the steps it skipped."""
    if scaler is None:
        return {}
    return {"loss_scale": scaler.value, "skipped_steps": scaler.skipped}
