"""Materialise a model built on the meta device, one layer at a time, with per-layer seeds.

A model too large for one rank cannot be built whole on every rank. Built under
``with torch.device("meta"):`` it costs no memory (shapes only); each pipeline rank then
allocates and initialises only its own stage's layers (:func:`materialize_layers`), so its
peak memory follows its stage, not the model.

Initialisation must not depend on the partition: layer ``i`` gets the same values whether
it lands on stage 0 of 1 or stage 3 of 4, and whether or not the ranks before it
initialised anything. So each layer draws from its own generator state, seeded from the
run's seed and the layer's index in the full model (:func:`layer_seed`), inside
``torch.random.fork_rng`` (the caller's random state is left as it was). The one-process
:func:`materialize` gives the same full model a pipeline of any depth starts from.

The initialiser is ``init(index, layer)``: it fills the layer's parameters and buffers in
place. The default calls ``reset_parameters()`` on every submodule that has one (torch's
layers all do; BatchNorm also resets its running statistics). Anything an initialiser
leaves unset would be uninitialised memory, so floating-point tensors are filled with NaN
before it runs and any NaN left afterwards is refused, naming the tensor.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from torch import nn

from syncline.errors import ConfigError

#: ``init(index, layer)``: initialise ``layer`` (the full model's layer ``index``) in place
LayerInit = Callable[[int, nn.Module], None]

_MIX = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: neighbouring indices get distant seeds


def layer_seed(seed: int, index: int) -> int:
    """The generator seed of layer ``index`` in a run seeded with ``seed``."""
    return (seed * _MIX + (index + 1) * 0xBF58476D1CE4E5B9) % (2**63 - 1)


def reset_parameters(index: int, layer: nn.Module) -> None:
    """The default initialiser: ``reset_parameters()`` of every submodule that has one."""
    del index
    for module in layer.modules():
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()


def is_meta(layer: nn.Module) -> bool:
    """Whether ``layer`` lives on the meta device (refusing a layer that is half on it)."""
    tensors = [*layer.parameters(), *layer.buffers()]
    meta = [t.is_meta for t in tensors]
    if any(meta) and not all(meta):
        raise ConfigError(
            f"{type(layer).__name__} has tensors both on the meta device and off it; build "
            "each layer wholly under torch.device('meta') or wholly on a real device"
        )
    return bool(meta) and all(meta)


def materialize_layers(
    layers: Sequence[tuple[int, nn.Module]],
    *,
    device: torch.device,
    seed: int,
    init: LayerInit | None = None,
) -> None:
    """Allocate the ``(index, layer)`` pairs that are on the meta device on ``device``
    (together, so weights tied between them stay tied) and initialise each from its own
    seed; real layers are left as they are (a model built eagerly keeps its weights).

    Raises:
        ConfigError: the initialiser left a floating-point parameter or buffer unset.
    """
    todo = [(i, layer) for i, layer in layers if is_meta(layer)]
    if not todo:
        return
    nn.ModuleList([layer for _, layer in todo]).to_empty(device=device)
    with torch.no_grad():
        for _, layer in todo:
            for t in [*layer.parameters(), *layer.buffers()]:
                if t.is_floating_point():
                    t.fill_(float("nan"))
                else:
                    t.zero_()
    devices = [device] if device.type == "cuda" else []
    for index, layer in todo:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.manual_seed(layer_seed(seed, index))
            (init or reset_parameters)(index, layer)
    for index, layer in todo:
        named = [*layer.named_parameters(), *layer.named_buffers()]
        unset = [n for n, t in named if t.is_floating_point() and bool(torch.isnan(t).any())]
        if unset:
            raise ConfigError(
                f"layer {index} ({type(layer).__name__}): the initialiser left {unset[:5]} "
                "unset (NaN); give an init(index, layer) that fills every parameter and buffer"
            )


def materialized_copy(
    layer: nn.Module, index: int, *, device: torch.device, seed: int, init: LayerInit | None
) -> nn.Module:
    """A real copy of ``layer`` as :func:`materialize_layer` makes it (the original is left
    on the meta device); for profiling one layer at a time."""
    if not is_meta(layer):
        return layer
    twin = copy.deepcopy(layer)
    materialize_layers([(index, twin)], device=device, seed=seed, init=init)
    return twin


def materialize(
    model: nn.Sequential,
    *,
    device: torch.device | str = "cpu",
    seed: int = 0,
    init: LayerInit | None = None,
) -> nn.Sequential:
    """The whole model, in one process, exactly as pipeline stages of any depth materialise
    their layers (same per-layer seeds); in place, returned for convenience.

    Example:
        >>> with torch.device("meta"):
        ...     model = build_gpt(GPTConfig(n_layer=2))
        >>> materialize(model, seed=0, init=gpt_layer_init(GPTConfig(n_layer=2)))
    """
    materialize_layers(list(enumerate(model)), device=torch.device(device), seed=seed, init=init)
    return model
