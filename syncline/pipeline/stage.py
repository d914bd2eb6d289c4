"""One pipeline stage's compute: forward, recompute, backward and step of micro-batches.

The runtime (:mod:`syncline.pipeline.runtime`) decides *when*; this module only does *what*
one action asks, for one stage. Micro-batches are keyed ``(batch, microbatch)``.

- forward: runs the stage on its input (2BW: on the action's weight version, installed in
  the stage's parameter slots for the call); the last stage also applies the loss. With
  recomputation the forward runs under ``no_grad`` and keeps only the input and the RNG
  state, so that the recompute draws the same dropout masks.
- recompute: the forward again, with autograd, just before the backward.
- backward: the last stage backpropagates ``loss / m`` (the batch loss is the mean of the m
  equal micro-batch means), the others the gradient received from the next stage; returns
  the gradient of the stage input for the previous stage.
- step: the optimizer (2BW: through :class:`~syncline.pipeline.versions.WeightVersions`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from syncline.errors import ConfigError
from syncline.pipeline.memory import StageMemoryStats, StashMeter, storage_key
from syncline.pipeline.packets import Codec, Single
from syncline.pipeline.precision import PipelinePrecision
from syncline.pipeline.versions import Tensors, WeightVersions

Key = tuple[int, int]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


@dataclass
class _MicroBatch:
    received: list[torch.Tensor]  # the stage's inputs (leaves that collect their gradient)
    inputs: Mapping[str, torch.Tensor] | None  # the model inputs (traced stages)
    version: int | None
    target: Any
    output: list[torch.Tensor] | None = None  # what the stage hands on (the last: its output)
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

    A stage of an ``nn.Sequential`` maps one tensor to one tensor. A stage of a traced model
    (:class:`~syncline.pipeline.traced_stage.TracedStage`) maps the values it receives and
    the micro-batch's model inputs to the values it hands on; its codecs say how those
    travel (:mod:`syncline.pipeline.packets`).
    """

    def __init__(
        self,
        index: int,
        module: nn.Module,
        *,
        last: bool,
        loss_fn: LossFn,
        optimizer: OptimizerFactory,
        num_microbatches: int,
        versioned: bool,
        track_memory: bool = True,
        precision: PipelinePrecision | None = None,
    ) -> None:
        self.index = index
        self.precision = precision
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
        self.traced = hasattr(module, "in_codec")
        self._in: Codec | None = getattr(module, "in_codec", Single()) if index else None
        self._out: Codec | None = None if last else getattr(module, "out_codec", Single())
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

    def _call(
        self,
        received: list[torch.Tensor],
        inputs: Mapping[str, torch.Tensor] | None,
        params: Tensors | None,
    ) -> Any:
        args: tuple[Any, ...] = (tuple(received), inputs) if self.traced else (received[0],)
        if params is None or self.versions is None:
            return self.module(*args)
        with self.versions.installed(params):
            return self.module(*args)

    def _run(
        self,
        received: list[torch.Tensor],
        inputs: Mapping[str, torch.Tensor] | None,
        params: Tensors | None,
        target: Any,
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        with self._autocast():
            out = self._call(received, inputs, params)
            if self.last:
                if self.traced:
                    (out,) = out
                return [out], self._loss_fn(out, target)
        return (list(out) if self.traced else [out]), None

    def _autocast(self) -> AbstractContextManager[None]:
        return nullcontext() if self.precision is None else self.precision.autocast()

    # -- actions -------------------------------------------------------------------------

    def forward(
        self,
        key: Key,
        x: torch.Tensor | None,
        version: int | None,
        target: Any,
        *,
        recompute: bool,
        inputs: Mapping[str, torch.Tensor] | None = None,
    ) -> torch.Tensor | None:
        """Run the forward of micro-batch ``key`` on ``x`` (what the previous stage sent;
        stage 0 of an ``nn.Sequential``: the micro-batch input) and, for a traced stage,
        the micro-batch's model ``inputs``; returns the message to send on (last: ``None``)."""
        batch = key[0]
        known = self._batch_version.setdefault(batch, version)
        if known != version:
            raise RuntimeError(f"batch {batch} ran on v{known} and now on v{version}")
        if self._in is not None:
            assert x is not None
            received = self._in.unpack(x)
        else:
            received = [] if x is None else [x]
        params = (
            None if self.versions is None or version is None else self.versions.acquire(version)
        )
        mb = _MicroBatch(received, inputs, version, target)
        self._inflight[key] = mb
        if x is not None:
            self.meter.note_input(x)
        if recompute:
            mb.rng = _rng_state(self._device(received, inputs))
            with torch.no_grad():
                out, loss = self._run(received, inputs, params, target)
            self.meter.add(key, received)
        else:
            with self._recording(key):
                out, loss = self._run(received, inputs, params, target)
            mb.output, mb.loss = out, loss
            self.meter.add(key, received if self.last else [*received, *out])
        if loss is not None:  # summed on the device: no host sync per micro-batch
            value = loss.detach().to(torch.float64)
            total = self._loss_sum.get(batch)
            self._loss_sum[batch] = value if total is None else total + value
        return None if self._out is None else self._out.pack(out, self.index)

    @staticmethod
    def _device(
        received: list[torch.Tensor], inputs: Mapping[str, torch.Tensor] | None
    ) -> torch.device:
        tensors = [*received, *(inputs or {}).values()]
        return tensors[0].device if tensors else torch.device("cpu")

    def infer(
        self, x: torch.Tensor | None, inputs: Mapping[str, torch.Tensor] | None
    ) -> torch.Tensor:
        """A forward-only pass (the caller disables autograd): the message to send on, or
        on the last stage the model's output. ``x`` and ``inputs`` as for :meth:`forward`."""
        if self._in is not None:
            assert x is not None
            received = self._in.unpack(x)
        else:
            received = [] if x is None else [x]
        with self._autocast():
            out = self._call(received, inputs, None)
        if self._out is None:
            return out[0] if self.traced else out
        return self._out.pack(list(out) if self.traced else [out], self.index)

    def recompute(self, key: Key) -> None:
        """Rebuild micro-batch ``key``'s activations (same weights, same RNG draws)."""
        mb = self._inflight[key]
        if mb.rng is None:
            raise RuntimeError(f"micro-batch {key} was not forwarded for recomputation")
        params = None
        if self.versions is not None and mb.version is not None:
            params = self.versions.tensors(mb.version)
        cpu, cuda = mb.rng
        device = self._device(mb.received, mb.inputs)
        devices = [device] if cuda is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state(cuda, device)
            with self._recording(key):
                mb.output, mb.loss = self._run(mb.received, mb.inputs, params, mb.target)
        self.meter.add(key, [] if self.last else mb.output)

    def backward(self, key: Key, grad_output: torch.Tensor | None) -> torch.Tensor | None:
        """Backward of micro-batch ``key``; returns its input gradient (``None`` on stage 0)."""
        mb = self._inflight.pop(key)
        if self._out is None:
            if mb.loss is None:
                raise RuntimeError(f"micro-batch {key} has no loss to backpropagate")
            scale = 1.0 if self.precision is None else self.precision.loss_scale(key[0])
            loss = mb.loss / self._m
            (loss if scale == 1.0 else loss * scale).backward()
        else:
            if mb.output is None or grad_output is None:
                raise RuntimeError(f"micro-batch {key} has no output or no received gradient")
            grads = self._out.unpack_grads(grad_output)
            pairs = [
                (out, grad)
                for out, grad in zip(mb.output, grads, strict=True)
                if grad is not None and out.requires_grad
            ]
            for out, grad in pairs:
                if grad.shape != out.shape:
                    raise RuntimeError(
                        f"received gradient of shape {tuple(grad.shape)} for an output of "
                        f"shape {tuple(out.shape)}"
                    )
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if self.versions is not None and mb.version is not None:
            self.versions.release(mb.version)
        self.meter.release(key)
        return None if self._in is None else self._in.pack_grads(mb.received)

    def grad_like(self, message: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype of the gradient that comes back for a sent ``message``."""
        assert self._out is not None
        return self._out.grad_like(message)

    def grad_holders(self, batch: int) -> list[torch.Tensor]:
        """The trainable tensors whose ``.grad`` holds ``batch``'s accumulated gradient, in
        parameter order: the Parameters, or under 2BW the weight version the batch ran on
        (its micro-batches' backwards accumulate there, not into the newest weights; the next
        batch, on another version or still before its first backward, adds nothing yet)."""
        return [t for t in self.named_grad_holders(batch).values() if t.requires_grad]

    def named_grad_holders(self, batch: int) -> dict[str, torch.Tensor]:
        """:meth:`grad_holders`, all of them, by the stage module's parameter names."""
        version = self._batch_version.get(batch)
        if self.versions is not None and version is not None:
            return dict(self.versions.tensors(version))
        return dict(self.module.named_parameters())

    def step(self, batch: int, produces: int | None, before: Callable[[], bool]) -> None:
        """The optimizer step after ``batch``'s last backward (2BW: makes ``produces``);
        ``before()``, with the gradients on the Parameters, says whether to step at all."""
        used = self._batch_version.pop(batch, None)
        if self.versions is None or used is None or produces is None:
            if before():
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            return
        self.versions.step(used, produces, self.optimizer, before)

    def load_state(self, state: Mapping[str, torch.Tensor], names: list[str], version: int) -> None:
        """Take the stage's weights and buffers from ``state``, where its ``state_dict`` entry
        ``i`` is named ``names[i]``; under 2BW they become the one version, ``version``."""
        local = self.module.state_dict(keep_vars=True)
        # in place: under 2BW the Parameters alias the newest version's buffers
        self.module.load_state_dict({k: state[n] for k, n in zip(local, names, strict=True)})
        if self.versions is not None:
            self.versions.renumber(version)

    def pop_loss(self, batch: int) -> torch.Tensor:
        """Mean loss of ``batch``'s micro-batches (last stage only): a float64 ``[1]`` on the
        loss's device, not read on the host."""
        return (self._loss_sum.pop(batch) / self._m).reshape(1)

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
