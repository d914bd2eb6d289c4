"""The guard against NaN/Inf and loss spikes, on the device, agreed inside the gradient allreduce.

Why inside the reduction: a rank that sees a NaN must not step while its peers do (the
replicas would part for good), and asking the others costs a collective and a host read per
step, a stall on a GPU. So each rank writes what it saw into two extra elements at the end
of the last bucket, which the step's own allreduce averages with the gradients:

    tail[0]  1 if this rank saw a non-finite loss or gradient, else 0  ->  > 0: some rank did
    tail[1]  this rank's loss                                          ->  the ranks' mean loss

Every rank then holds the same two numbers, and from them the same verdict, computed on the
device (:meth:`StepGuard.settle`): an event when some rank saw a non-finite value, or when
the mean loss exceeds ``spike_factor`` x the median of the last ``spike_window`` good ones.
The verdict is a small device tensor (:attr:`StepGuard.verdict`); the optimizer skips on it
without a host read (:func:`syncline.optim.skip.step_unless`), and the host copies it when it
reads anyway, one step later (:mod:`syncline.train.guarding`).

Each bucket is checked as it leaves, before the allreduce overwrites it: one fused norm per
bucket (``torch._foreach_norm``; a norm is finite iff every element is, short of an overflow
of the norm itself, which counts as an event too), which also yields this rank's first
non-finite parameter for the ``stop`` line. The bucket that carries the tail goes last, so
every other bucket has been checked when the flag is written.

Limits: the tail rides a compressor that reduces every element of a bucket (``none``,
``fp16``, ``bf16``); one that sparsifies or factorises (CSC, TopK, PowerSGD) might drop it,
and its residual would have to be rolled back on a skipped step, so the engine refuses that
pair. One gradient dtype, and no sparse gradients (their own collectives carry no tail).
"""

from __future__ import annotations

from typing import Any

import torch

from syncline.dp.compression import Compressor
from syncline.dp.guard_config import GuardConfig
from syncline.errors import ConfigError

__all__ = ["VERDICT_FIELDS", "StepGuard", "check_guardable"]

#: the entries of :attr:`StepGuard.verdict`, in order
VERDICT_FIELDS = (
    "event",  # 1: this step is an event (non-finite or spike): its update is dropped
    "nonfinite",  # 1: some rank saw a NaN or Inf in its loss or gradient
    "spike",  # 1: the mean loss exceeded spike_factor x the window's median
    "local",  # 1: this rank saw a non-finite value
    "first_bad",  # this rank's first non-finite parameter (index; the count of them: none)
    "loss",  # the ranks' mean loss
    "median",  # the median of the window before this step (NaN until it is full)
    "skip",  # 1: the optimizer drops this step's update (the event, or a latched one)
)


class StepGuard:
    """One engine's guard: where this rank's observations go, and the agreed verdict.

    Args:
        config: what counts as an event and what it does (``stop`` and ``rollback`` latch:
            once an event is seen, every later update is dropped too, until the host acts,
            so nothing after the event reaches the weights however far the host ran ahead).

    The engine calls :meth:`attach` (device, parameter names), :meth:`begin`,
    :meth:`observe`, :meth:`fill_tail` and :meth:`settle` during each synchronised backward;
    the caller gives the loss with :meth:`watch_loss` before ``backward()``.

    Example:
        >>> guard = StepGuard(GuardConfig(on_nonfinite="skip"))
        >>> model = DataParallel(net, guard=guard)
        >>> loss = loss_fn(model(x), y)
        >>> guard.watch_loss(loss)
        >>> loss.backward()
        >>> step_unless(opt, guard.skip_flag)   # no host read
    """

    #: elements the guard adds at the end of the last bucket
    TAIL = 2

    def __init__(self, config: GuardConfig) -> None:
        if not config.on:
            raise ValueError("StepGuard: config.on_nonfinite is 'off'; pass no guard instead")
        self.config = config
        self.names: list[str] = []
        self._attached = False
        self._loss_watched = False

    def attach(self, device: torch.device, names: list[str]) -> None:
        """Make the device state for parameters ``names`` on ``device`` (once, by the engine)."""
        if self._attached:
            raise ValueError("StepGuard: this guard already serves an engine; make one per engine")
        self._attached = True
        self.names = list(names)
        self.device = device
        self.local = torch.zeros((), device=device)
        self.first_bad = torch.zeros((), dtype=torch.int64, device=device)
        self.loss = torch.zeros((), device=device)
        self.window = torch.full((self.config.spike_window,), float("nan"), device=device)
        self.latched = torch.zeros((), device=device)
        self.verdict = torch.zeros(len(VERDICT_FIELDS), device=device)
        self._index: dict[tuple[int, ...], torch.Tensor] = {}

    @property
    def skip_flag(self) -> torch.Tensor:
        """Nonzero (on the device): drop the last settled step's update."""
        return self.verdict[VERDICT_FIELDS.index("skip")]

    def watch_loss(self, loss: torch.Tensor) -> None:
        """This rank's loss of the coming backward (a non-finite one is an event; the mean
        over the ranks is what the spike test compares)."""
        self.loss.copy_(loss.detach().reshape(()))
        self._loss_watched = True

    def begin(self) -> None:
        """A synchronised backward starts: nothing seen yet."""
        self.local.zero_()
        self.first_bad.fill_(len(self.names))

    def observe(self, grads: list[torch.Tensor], params: tuple[int, ...]) -> None:
        """Check a bucket's gradients (parameters ``params``) before they are reduced."""
        if not grads:
            return
        index = self._index.get(params)
        if index is None:
            index = self._index[params] = torch.tensor(
                params, dtype=torch.int64, device=self.device
            )
        bad = ~torch.isfinite(torch.stack(torch._foreach_norm(grads)))
        torch.maximum(self.local, bad.any().to(self.local.dtype), out=self.local)
        first = torch.where(bad, index, len(self.names)).min()  # len(names): none here
        torch.minimum(self.first_bad, first, out=self.first_bad)

    def fill_tail(self, tail: torch.Tensor) -> None:
        """Write this rank's flag and loss into the tail of the last bucket."""
        torch.maximum(self.local, (~torch.isfinite(self.loss)).to(self.local.dtype), out=self.local)
        tail.copy_(torch.stack([self.local, self.loss]).to(tail.dtype))

    def settle(self, tail: torch.Tensor) -> None:
        """After the reduction: the agreed verdict from the averaged tail (every rank the same).

        Raises:
            RuntimeError: a spike test without :meth:`watch_loss` this step.
        """
        if self.config.spike_factor is not None and not self._loss_watched:
            raise RuntimeError(
                "StepGuard: spike_factor is set but no loss was given; call "
                "guard.watch_loss(loss) before loss.backward()"
            )
        self._loss_watched = False
        flag, mean = tail[0].float(), tail[1].float()
        nonfinite = ((flag > 0) | ~torch.isfinite(mean)).float()
        window = self.window
        median = torch.nanmedian(window)
        if self.config.spike_factor is None:
            spike = torch.zeros_like(nonfinite)
        else:
            full = ~torch.isnan(window).any()
            spike = (full & (mean > self.config.spike_factor * median)).float()
        event = torch.maximum(nonfinite, spike)
        if self.config.on_nonfinite == "skip":
            skip = event
        else:  # stop, rollback: nothing after the event may reach the weights
            torch.maximum(self.latched, event, out=self.latched)
            skip = self.latched.clone()
        shifted = torch.cat([window[1:], mean.reshape(1)])
        window.copy_(torch.where(event > 0, window, shifted))
        self.verdict.copy_(
            torch.stack(
                [event, nonfinite, spike, self.local, self.first_bad.float(), mean, median, skip]
            )
        )

    def clear_latch(self) -> None:
        """After a rollback: updates flow again."""
        self.latched.zero_()
        self.verdict.zero_()

    def name_of(self, index: int) -> str | None:
        """The parameter at ``index`` (as :attr:`verdict`'s ``first_bad`` gives it), or
        ``None`` for the count (no parameter was non-finite)."""
        return self.names[index] if 0 <= index < len(self.names) else None


def check_guardable(
    compressor: Compressor, params: list[torch.Tensor], sparse: list[Any], *, periodic: bool = False
) -> None:
    """Refuse a guard where its verdict could not ride the allreduce (the module says why).

    Raises:
        ConfigError: a compressor that keeps per-bucket state, several gradient dtypes,
            sparse gradients, or a periodic sync (local SGD, DiLoCo: most steps have no
            allreduce for the verdict to ride).
    """
    if periodic:
        raise ConfigError(
            "DataParallel: guard= with a periodic sync (local SGD, DiLoCo) is not supported: "
            "the guard's verdict rides each step's gradient allreduce, which these skip; "
            "valid: sync='every-step'"
        )
    if not compressor.stateless:
        raise ConfigError(
            f"DataParallel: guard= with compression {compressor.name!r} is not supported: the "
            "guard's verdict rides the bucket allreduce, which this compressor sparsifies or "
            "factorises, and its residual would have to be rolled back on a skipped step; "
            "valid: compression none, fp16 or bf16"
        )
    dtypes = sorted({str(p.dtype) for p in params})
    if len(dtypes) > 1 or sparse:
        raise ConfigError(
            f"DataParallel: guard= needs one gradient dtype and no sparse gradients; got "
            f"dtypes {dtypes} and {len(sparse)} sparse parameter(s)"
        )
