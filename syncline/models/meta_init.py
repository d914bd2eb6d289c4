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

Initialisation must not depend on the device either: CUDA's generator (Philox) draws other
numbers than the CPU's (Mersenne Twister) from the same seed, so a pipeline materialising its
stages on a GPU would start from other weights than data parallelism building the model on
the CPU. So every layer is materialised and initialised on the CPU, from the CPU generator
(:func:`cpu_seeded`: CUDA's generators are neither seeded nor read), checked there, then
copied to its device one layer at a time (host memory holds one layer beyond the model).

The initialiser is ``init(index, layer)``: it fills the layer's parameters and buffers in
place. The default calls ``reset_parameters()`` on every submodule that has one (torch's
layers all do; BatchNorm also resets its running statistics). Anything an initialiser
leaves unset would be uninitialised memory, so floating-point tensors are filled with NaN
before it runs and any NaN left afterwards is refused, naming the tensor.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch import nn

from syncline.errors import ConfigError

#: ``init(index, layer)``: initialise ``layer`` (the full model's layer ``index``) in place
LayerInit = Callable[[int, nn.Module], None]

_MIX = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: neighbouring indices get distant seeds


def layer_seed(seed: int, index: int) -> int:
    """The generator seed of layer ``index`` in a run seeded with ``seed``."""
    return (seed * _MIX + (index + 1) * 0xBF58476D1CE4E5B9) % (2**63 - 1)


def own_reset(module: nn.Module) -> Callable[[], None] | None:
    """The module's own initialisation: ``reset_parameters()``, or ``_reset_parameters()``
    for the torch modules that name it so (``nn.MultiheadAttention``, and through it
    ``nn.TransformerEncoderLayer`` and ``nn.Transformer``); ``None`` without one."""
    for name in ("reset_parameters", "_reset_parameters"):
        reset = getattr(module, name, None)
        if callable(reset):
            return cast(Callable[[], None], reset)
    return None


def reset_parameters(index: int, layer: nn.Module) -> None:
    """The default initialiser: each submodule's own initialisation (:func:`own_reset`)."""
    del index
    for module in layer.modules():
        reset = own_reset(module)
        if reset is not None:
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


@contextmanager
def cpu_seeded(seed: int) -> Iterator[torch.Generator]:
    """Run the body with the CPU's default generator seeded with ``seed``, and restore the
    caller's CPU random state afterwards; CUDA's generators are left alone (``torch.manual_seed``
    would reseed every GPU's too). Yields the generator, for initialisers that take one."""
    with torch.random.fork_rng(devices=[]):
        yield torch.default_generator.manual_seed(seed)


def _slots(module: nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
    """The dicts holding ``module``'s own parameters and buffers (assigned into in place)."""
    return module._parameters, module._buffers


def _on_cpu(layer: nn.Module, made: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Replace ``layer``'s meta tensors by CPU ones (NaN-filled floats, zeroed others). A
    tensor met before (tied to an earlier layer: ``made`` maps the meta tensor's id to it)
    gets the same CPU tensor, so ties hold."""
    for module in layer.modules():
        for slots in _slots(module):
            for key, t in slots.items():
                if t is None or not t.is_meta:
                    continue
                if id(t) not in made:
                    real = torch.empty_like(t, device="cpu")
                    real.fill_(float("nan")) if real.is_floating_point() else real.zero_()
                    if isinstance(t, nn.Parameter):
                        real = nn.Parameter(real, requires_grad=t.requires_grad)
                    made[id(t)] = (t, real)  # the meta tensor kept alive: its id stays unique
                slots[key] = made[id(t)][1]


def _to_device(
    layer: nn.Module, device: torch.device, moved: dict[int, tuple[torch.Tensor, torch.Tensor]]
) -> None:
    """Copy ``layer``'s CPU-initialised tensors (those in ``moved``' keys or new to it) to
    ``device``; a tensor tied to an earlier layer gets the same device tensor, refreshed
    (the later layer's initialiser may have drawn it again)."""
    for module in layer.modules():
        for slots in _slots(module):
            for key, t in slots.items():
                if t is None or t.device.type != "cpu":
                    continue
                if id(t) in moved:
                    with torch.no_grad():
                        moved[id(t)][1].copy_(t)
                else:
                    real = torch.empty_like(t, device=device)
                    with torch.no_grad():
                        real.copy_(t)
                    if isinstance(t, nn.Parameter):
                        real = nn.Parameter(real, requires_grad=t.requires_grad)
                    moved[id(t)] = (t, real)
                slots[key] = moved[id(t)][1]


def _tied(layers: Iterable[nn.Module]) -> set[int]:
    """The ids of the tensors held by more than one of ``layers`` (kept on the CPU until
    the last holder is initialised)."""
    seen: set[int] = set()
    tied: set[int] = set()
    for layer in layers:
        mine = {id(t) for t in [*layer.parameters(), *layer.buffers()]}
        tied |= mine & seen
        seen |= mine
    return tied


def materialize_layers(
    layers: Sequence[tuple[int, nn.Module]],
    *,
    device: torch.device,
    seed: int,
    init: LayerInit | None = None,
) -> None:
    """Allocate the ``(index, layer)`` pairs that are on the meta device on ``device`` and
    initialise each from its own seed, on the CPU, from the CPU generator (so the values do
    not depend on ``device``), then copy it there; weights tied between the layers stay
    tied; real layers are left as they are (a model built eagerly keeps its weights).

    Raises:
        ConfigError: the initialiser left a floating-point parameter or buffer unset.
    """
    todo = [(i, layer) for i, layer in layers if is_meta(layer)]
    made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    moved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    tied = _tied(layer for _, layer in todo)
    for index, layer in todo:
        _on_cpu(layer, made)
        with cpu_seeded(layer_seed(seed, index)), torch.no_grad():
            (init or reset_parameters)(index, layer)
        named = [*layer.named_parameters(), *layer.named_buffers()]
        unset = [n for n, t in named if t.is_floating_point() and bool(torch.isnan(t).any())]
        if unset:
            raise ConfigError(
                f"layer {index} ({type(layer).__name__}): the initialiser left {unset[:5]} "
                "unset (NaN); give an init(index, layer) that fills every parameter and buffer"
            )
        if device.type != "cpu":
            _to_device(layer, device, moved)
            for key in [k for k in made if k not in tied]:  # host memory: one layer at a time
                _, cpu = made.pop(key)
                moved.pop(id(cpu), None)


def materialized_copy(
    layer: nn.Module, index: int, *, device: torch.device, seed: int, init: LayerInit | None
) -> nn.Module:
    """A real copy of ``layer`` as :func:`materialize_layers` makes it (the original is left
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
