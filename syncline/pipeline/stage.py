"""One pipeline stage's compute: forward, recompute, backward and step of micro-batches.

The runtime (:mod:`syncline.pipeline.runtime`) decides *when*; this module only does *what*
one action asks, for one stage. Micro-batches are keyed ``(batch, microbatch)``.

- forward: runs the stage on its input (2BW: on the action's weight version through
  ``torch.func.functional_call``); the last stage also applies the loss. With
  recomputation the forward runs under ``no_grad`` and keeps only the input and the RNG
  state, so that the recompute draws the same dropout masks.
- recompute: the forward again, with autograd, just before the backward.
- backward: the last stage backpropagates ``loss / m`` (the batch loss is the mean of the m
  equal micro-batch means), the others the gradient received from the next stage; returns
  the gradient of the stage input for the previous stage.
- step: the optimizer (2BW: through :class:`~syncline.pipeline.versions.WeightVersions`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from syncline.errors import ConfigError
from syncline.pipeline.memory import StageMemoryStats, StashMeter, storage_key
from syncline.pipeline.versions import Tensors, WeightVersions

Key = tuple[int, int]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


@dataclass
class _MicroBatch:
    input: torch.Tensor
    version: int | None
    target: torch.Tensor | None
    output: torch.Tensor | None = None
    loss: torch.Tensor | None = None
    rng: tuple[torch.Tensor, torch.Tensor | None] | None = None


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


class Stage:
    """State and compute of one stage on this rank.

    Args:
        index: the stage number.
        module: the stage's layers.
        last: whether it is the last stage (applies ``loss_fn``).
        loss_fn: ``loss_fn(output, target) -> scalar``, the micro-batch mean.
        optimizer: factory applied to ``module.parameters()``.
        num_microbatches: m, the loss divisor.
        versioned: keep 2BW weight versions.
        track_memory: count what autograd saves (a Python hook per saved tensor, a few
            per cent of a small model's step); without it only the stage inputs and
            outputs the pipeline holds are counted.
    """

    def __init__(
        self,
        index: int,
        module: nn.Sequential,
        *,
        last: bool,
        loss_fn: LossFn,
        optimizer: OptimizerFactory,
        num_microbatches: int,
        versioned: bool,
        track_memory: bool = True,
    ) -> None:
        self.index = index
        self.module = module
        self.first = index == 0
        self.last = last
        self._loss_fn = loss_fn
        self._m = num_microbatches
        self.optimizer = optimizer(module.parameters())
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise ConfigError(
                f"optimizer factory returned {type(self.optimizer).__name__}; "
                "valid: a torch.optim.Optimizer, e.g. lambda ps: torch.optim.SGD(ps, lr=0.1)"
            )
        self.versions = WeightVersions(module, 0) if versioned else None
        self.meter = StashMeter()
        self.track_memory = track_memory
        self._inflight: dict[Key, _MicroBatch] = {}
        self._batch_version: dict[int, int | None] = {}
        self._loss_sum: dict[int, torch.Tensor] = {}
        for p in module.parameters():
            p.grad = None

    # -- helpers -------------------------------------------------------------------------

    def _weights(self) -> set[int]:
        ptrs = {storage_key(p)[0] for p in self.module.parameters()}
        return ptrs | (self.versions.storages() if self.versions is not None else set())

    def _recording(self, key: Key) -> AbstractContextManager[None]:
        return self.meter.recording(key, self._weights) if self.track_memory else nullcontext()

    def _run(
        self, x: torch.Tensor, params: Tensors | None, target: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        out: Any = self.module(x) if params is None else functional_call(self.module, params, (x,))
        if not isinstance(out, torch.Tensor):
            raise TypeError(
                f"stage {self.index} returned {type(out).__name__}; every stage must map one "
                "tensor to one tensor"
            )
        if not self.last:
            if not out.is_floating_point():
                raise TypeError(
                    f"stage {self.index} output has dtype {out.dtype}; activations passed "
                    "between stages must be floating point (they carry gradients back)"
                )
            return out, None
        assert target is not None
        return out, self._loss_fn(out, target)

    # -- actions -------------------------------------------------------------------------

    def forward(
        self,
        key: Key,
        x: torch.Tensor,
        version: int | None,
        target: torch.Tensor | None,
        *,
        recompute: bool,
    ) -> torch.Tensor:
        """Run the forward of micro-batch ``key``; returns the output to send on."""
        batch = key[0]
        known = self._batch_version.setdefault(batch, version)
        if known != version:
            raise RuntimeError(f"batch {batch} ran on v{known} and now on v{version}")
        if not self.first and x.is_floating_point():
            x = x.detach().requires_grad_()
        params = (
            None if self.versions is None or version is None else self.versions.acquire(version)
        )
        mb = _MicroBatch(x, version, target)
        self._inflight[key] = mb
        self.meter.note_input(x)
        if recompute:
            mb.rng = _rng_state(x.device)
            with torch.no_grad():
                out, loss = self._run(x, params, target)
            self.meter.add(key, [x])
        else:
            with self._recording(key):
                out, loss = self._run(x, params, target)
            mb.output, mb.loss = out, loss
            self.meter.add(key, [x] if self.last else [x, out])
        if loss is not None:
            total = self._loss_sum.get(batch, torch.zeros((), dtype=torch.float64))
            self._loss_sum[batch] = total + loss.detach().to("cpu", torch.float64)
        return out

    def recompute(self, key: Key) -> None:
        """Rebuild micro-batch ``key``'s activations (same weights, same RNG draws)."""
        mb = self._inflight[key]
        if mb.rng is None:
            raise RuntimeError(f"micro-batch {key} was not forwarded for recomputation")
        params = None
        if self.versions is not None and mb.version is not None:
            params = self.versions.tensors(mb.version)
        cpu, cuda = mb.rng
        devices = [mb.input.device] if cuda is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state(cuda, mb.input.device)
            with self._recording(key):
                mb.output, mb.loss = self._run(mb.input, params, mb.target)
        self.meter.add(key, [] if self.last else [mb.output])

    def backward(self, key: Key, grad_output: torch.Tensor | None) -> torch.Tensor | None:
        """Backward of micro-batch ``key``; returns its input gradient (``None`` on stage 0)."""
        mb = self._inflight.pop(key)
        if self.last:
            if mb.loss is None:
                raise RuntimeError(f"micro-batch {key} has no loss to backpropagate")
            (mb.loss / self._m).backward()
        else:
            if mb.output is None or grad_output is None:
                raise RuntimeError(f"micro-batch {key} has no output or no received gradient")
            if grad_output.shape != mb.output.shape:
                raise RuntimeError(
                    f"received gradient of shape {tuple(grad_output.shape)} for an output of "
                    f"shape {tuple(mb.output.shape)}"
                )
            torch.autograd.backward(mb.output, grad_output)
        if self.versions is not None and mb.version is not None:
            self.versions.release(mb.version)
        self.meter.release(key)
        if self.first:
            return None
        grad = mb.input.grad
        return torch.zeros_like(mb.input) if grad is None else grad

    def grad_holders(self, batch: int) -> list[torch.Tensor]:
        """The trainable tensors whose ``.grad`` holds ``batch``'s accumulated gradient, in
        parameter order: the Parameters, or under 2BW the weight version the batch ran on
        (its micro-batches' backwards accumulate there, not into the newest weights; the next
        batch, on another version or still before its first backward, adds nothing yet)."""
        version = self._batch_version.get(batch)
        if self.versions is not None and version is not None:
            tensors = self.versions.tensors(version).values()
            return [t for t in tensors if t.requires_grad]
        return [p for p in self.module.parameters() if p.requires_grad]

    def step(self, batch: int, produces: int | None, before: Callable[[], None]) -> None:
        """The optimizer step after ``batch``'s last backward (2BW: makes ``produces``)."""
        used = self._batch_version.pop(batch, None)
        if self.versions is None or used is None or produces is None:
            before()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            return
        self.versions.step(used, produces, self.optimizer, before)

    def pop_loss(self, batch: int) -> float:
        """Mean loss of ``batch``'s micro-batches (last stage only)."""
        return float(self._loss_sum.pop(batch)) / self._m

    def end_run(self) -> None:
        """No batch in flight any more (flush): drop the older weight version."""
        if self._inflight:
            raise RuntimeError(f"stage {self.index}: {sorted(self._inflight)} still in flight")
        if self.versions is not None:
            self.versions.keep_newest()

    def memory_stats(self) -> StageMemoryStats:
        meter = self.meter
        if self.versions is not None:
            count, one = self.versions.peak_versions, self.versions.version_bytes
        else:
            count = 1
            one = sum(p.numel() * p.element_size() for p in self.module.parameters())
        return StageMemoryStats(
            stage=self.index,
            peak_activation_bytes=meter.peak,
            peak_microbatches=meter.peak_microbatches,
            microbatch_activation_bytes=meter.microbatch_peak,
            input_bytes=meter.input_peak,
            weight_versions=count,
            peak_weight_bytes=count * one,
            autograd_measured=self.track_memory,
        )

    def reset_memory_stats(self) -> None:
        self.meter.reset()
        if self.versions is not None:
            self.versions.peak_versions = len(self.versions.held)
