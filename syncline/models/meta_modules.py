"""Materialise any model built on the meta device, module by module, seeded by module name.

:mod:`syncline.models.meta_init` materialises an ``nn.Sequential`` layer by layer, seeded
by layer index. A model split at named modules (a HuggingFace GPT-2) has no layer index, so
here the unit is the module that directly owns parameters or buffers (a ``Linear``, a
``LayerNorm``, an ``Embedding``), seeded by its fully-qualified name in the model
(:func:`module_seed`). A pipeline stage materialises only the owners of its own tensors; the
one-process :func:`materialize_modules` gives the same full model, so the weights do not
depend on the split; as there, values are drawn on the CPU from the CPU generator and then
copied to the device, so they do not depend on the device either.

The initialiser is ``init(name, module)``, called for the owner and then for each of its
ancestors up to the model itself (nearest first), each time with only the owner's tensors
real (the rest of the model stays on the meta device, where writes do nothing). A parent's
rule over its children's weights therefore applies, as ``model.apply(model._init_weights)``
would apply it: GPT-2's scaled residual projections are drawn by its attention and MLP
modules. Without one, the owner's own initialisation runs (``reset_parameters()``, or
``_reset_parameters()`` as ``nn.MultiheadAttention`` names it: torch's layers); a tensor
left unset (NaN-filled first) is refused, naming it.

Tied weights (GPT-2's embedding and head) are one tensor under several names: it is
initialised once, by the owner of its first name (``model.named_parameters()`` order), and
every name gets the same values, also on two different stages.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable, Iterator, Mapping

import torch
from torch import nn

from syncline.errors import ConfigError
from syncline.models.meta_init import cpu_seeded, layer_seed, own_reset

__all__ = ["ModuleInit", "materialize_modules", "materialize_named", "module_seed"]

#: ``init(name, module)``: initialise ``module`` (called ``name`` in the model) in place
ModuleInit = Callable[[str, nn.Module], None]


def module_seed(seed: int, name: str) -> int:
    """The generator seed of the module called ``name`` in a run seeded with ``seed``."""
    digest = hashlib.blake2b(f"syncline/module/{name}".encode(), digest_size=8).digest()
    return layer_seed(seed, int.from_bytes(digest, "little") >> 2)


def _owned(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors ``module`` itself holds (not its children's)."""
    yield from ((k, v) for k, v in module._parameters.items() if v is not None)
    yield from ((k, v) for k, v in module._buffers.items() if v is not None)


def _initialised(
    model: nn.Module, name: str, *, device: torch.device, seed: int, init: ModuleInit | None
) -> dict[str, torch.Tensor]:
    """Real, initialised copies of the tensors the module ``name`` of ``model`` holds (its
    children and the model stay on the meta device)."""
    owner = model.get_submodule(name)
    twin = copy.copy(owner)  # shares the children; own tensor dicts, filled below
    twin._parameters = dict(owner._parameters)
    twin._buffers = dict(owner._buffers)
    with torch.no_grad():
        for key, t in _owned(owner):
            real = torch.empty_like(t, device="cpu")  # drawn on the CPU, see below
            real.fill_(float("nan")) if real.is_floating_point() else real.zero_()
            if key in owner._parameters:
                twin._parameters[key] = nn.Parameter(real, requires_grad=t.requires_grad)
            else:
                twin._buffers[key] = real
    chain = [(name, twin)]  # the owner, then each ancestor holding the copy below it
    while chain[-1][0]:
        child_name = chain[-1][0]
        parent_name, _, leaf = child_name.rpartition(".")
        parent = copy.copy(model.get_submodule(parent_name))
        parent._modules = {**parent._modules, leaf: chain[-1][1]}
        chain.append((parent_name, parent))
    with cpu_seeded(module_seed(seed, name)), torch.no_grad():
        if init is None:
            reset = own_reset(twin)
            if reset is not None:
                reset()
        else:
            for chain_name, module in chain:
                init(chain_name, module)
    values = dict(_owned(twin))
    unset = [k for k, t in values.items() if t.is_floating_point() and bool(t.isnan().any())]
    if unset:
        hint = "its reset_parameters()" if init is None else "the initialiser"
        raise ConfigError(
            f"{name or 'the model'} ({type(owner).__name__}): {hint} left {unset} unset (NaN); "
            "give an init(name, module) that fills every parameter and buffer"
        )
    return values if device.type == "cpu" else {k: _copied(t, device) for k, t in values.items()}


def _copied(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (initialised on the CPU) copied to ``device``, a parameter as a parameter."""
    real = torch.empty_like(t, device=device)
    with torch.no_grad():
        real.copy_(t)
    if isinstance(t, nn.Parameter):
        return nn.Parameter(real, requires_grad=t.requires_grad)
    return real


def materialize_named(
    target: nn.Module,
    model: nn.Module,
    canonical: Mapping[str, str],
    *,
    device: torch.device,
    seed: int,
    init: ModuleInit | None = None,
) -> None:
    """Replace ``target``'s tensors on the meta device by real ones, initialised as the
    tensor ``canonical[name]`` of ``model`` is (``target``: a stage holding some of the
    model's tensors, perhaps under other names); real tensors are left as they are.

    Raises:
        ConfigError: a tensor the model does not have, or one the initialiser left unset.
    """
    made: dict[int, torch.Tensor] = {}  # one meta tensor under several names: one copy
    cache: dict[str, dict[str, torch.Tensor]] = {}
    slots = []
    # every value first, then every assignment: the model stays on the meta device while
    # initialisers run (``target`` may be the model itself), so an ancestor's rule writes
    # only into the owner it was called for, never into a sibling made before
    for module_name, module in target.named_modules(remove_duplicate=False):
        for key, t in _owned(module):
            if not t.is_meta:
                continue
            full = f"{module_name}.{key}" if module_name else key
            slots.append((module, key, t))
            if id(t) in made:
                continue
            owner, _, leaf = canonical.get(full, full).rpartition(".")
            if owner not in cache:
                cache[owner] = _initialised(model, owner, device=device, seed=seed, init=init)
            if leaf not in cache[owner]:
                raise ConfigError(f"{full}: the model has no tensor {canonical.get(full)!r}")
            value = cache[owner][leaf]
            if key in module._parameters and not isinstance(value, nn.Parameter):
                value = nn.Parameter(value, requires_grad=t.requires_grad)
            made[id(t)] = value
    for module, key, t in slots:
        if key in module._parameters:
            module._parameters[key] = made[id(t)]
        else:
            module._buffers[key] = made[id(t)]


def materialize_modules(
    model: nn.Module,
    *,
    device: torch.device | str = "cpu",
    seed: int = 0,
    init: ModuleInit | None = None,
) -> nn.Module:
    """The whole model, in one process, exactly as pipeline stages split at any points
    materialise their parts (same per-module seeds); in place, returned for convenience.

    Example:
        >>> with torch.device("meta"):
        ...     model = transformers.GPT2LMHeadModel(config)
        >>> materialize_modules(model, seed=0, init=lambda _, m: model._init_weights(m))
    """
    first: dict[int, str] = {}
    canonical = {}
    named = [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]
    for name, t in named:
        canonical[name] = first.setdefault(id(t), name)
    materialize_named(model, model, canonical, device=torch.device(device), seed=seed, init=init)
    return model
