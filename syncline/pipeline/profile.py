"""Measure each layer's forward + backward time and stashed activation bytes on a sample.

The balancer (:mod:`syncline.partition`) takes numbers; this produces them, as torchgpipe's
``balance_by_time`` does: run the layers one after another on a sample micro-batch, time the
forward and the backward of each (median of ``repeats`` runs after one warm-up), and count
what autograd saves. Parameters' ``.grad`` and the RNG state are left as they were. Times
come from :class:`syncline.comm.device.Stopwatch` (CUDA events on a GPU: the work, not its
launch; ``perf_counter`` on the CPU).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from syncline.comm.device import Stopwatch
from syncline.pipeline.memory import StashMeter, storage_key


@dataclass(frozen=True)
class LayerProfile:
    """Per-layer measurements, in layer order.

    Attributes:
        seconds: forward + backward time of each layer on the sample.
        activation_bytes: bytes autograd saves for the backward of each layer.
        weight_bytes: parameter bytes of each layer.
        forward_seconds: the forward's share of ``seconds`` (median over the repeats).
        output_bytes: bytes of each layer's output (what a stage ending there sends).
        params: parameter elements of each layer.
    """

    seconds: list[float]
    activation_bytes: list[int]
    weight_bytes: list[int]
    forward_seconds: list[float] = field(default_factory=list)
    output_bytes: list[int] = field(default_factory=list)
    params: list[int] = field(default_factory=list)


def profile_layers(
    layers: nn.Sequential,
    sample: torch.Tensor,
    *,
    repeats: int = 3,
    prepare: Callable[[int, nn.Module], nn.Module] | None = None,
) -> LayerProfile:
    """Profile ``layers`` on ``sample`` (one micro-batch of stage-0 input).

    ``prepare(index, layer)`` gives the module to run for a layer (a real copy of one on
    the meta device, dropped once measured, so only one layer at a time is allocated).

    Raises:
        TypeError: a layer does not return one tensor.
    """
    grads = {p: p.grad for p in layers.parameters()}
    seconds, act, weights, forwards, outputs, params = [], [], [], [], [], []
    forward, both = Stopwatch(sample.device), Stopwatch(sample.device)
    with torch.random.fork_rng(devices=[sample.device] if sample.device.type == "cuda" else []):
        h = sample
        for index, original in enumerate(layers):
            layer = original if prepare is None else prepare(index, original)
            times, ftimes, saved, out = [], [], 0, h
            for rep in range(repeats + 1):
                x = h.detach().requires_grad_(h.is_floating_point())
                meter = StashMeter()
                skip = {storage_key(p)[0] for p in layer.parameters()}
                both.start()
                forward.start()
                with meter.recording(rep, skip.copy):
                    out = layer(x)
                if not isinstance(out, torch.Tensor):
                    raise TypeError(f"layer {index} returned {type(out).__name__}, not a tensor")
                forward.stop()
                if out.requires_grad:
                    out.backward(torch.ones_like(out))
                both.stop()
                if rep:
                    times.append(both.elapsed_s())
                    ftimes.append(forward.elapsed_s())
                saved = meter.peak
            seconds.append(statistics.median(times))
            forwards.append(min(statistics.median(ftimes), seconds[-1]))
            outputs.append(out.numel() * out.element_size())
            params.append(sum(p.numel() for p in layer.parameters()))
            act.append(saved)
            weights.append(sum(p.numel() * p.element_size() for p in layer.parameters()))
            h = out.detach()
    for p, g in grads.items():
        p.grad = g
    return LayerProfile(seconds, act, weights, forwards, outputs, params)
