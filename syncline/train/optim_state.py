"""Any optimizer's state as checkpoint entries, restored exactly, type for type.

``torch.optim`` keeps tensors (AdamW's moments and its 0-d ``step``), but an optimizer may
keep plain Python values too: LAMB's ``step`` is an ``int``, L-BFGS keeps lists of tensors
and floats, a plug-in whatever its algorithm needs. The entries are:

``optim/NAME/KEY``
    a tensor of parameter ``NAME``'s state, as itself (the large part: never pickled);
``optim/hparams``
    the hyper-parameters of the (single) parameter group, packed;
``optim-values/FIRST``
    every other state value of the optimizer's parameters (``FIRST``: the name of its first
    parameter, so that each pipeline stage's optimizer has its own key and a data-parallel
    replica's the same one, written once), packed, with the order of each parameter's keys.

Packed values travel as bytes read back with ``weights_only=True``
(:func:`~syncline.comm.sharded.unpack_object`), which rebuilds plain data type for type and
nothing else. So only plain data is accepted (:data:`PLAIN`, and lists, tuples, dicts and sets
of it, tensors included); anything else is refused with a :class:`CheckpointError` naming the
optimizer, the entry and its type, rather than written and found unreadable at the resume.
Restoring sets each packed value after ``load_state_dict``, as it was saved: torch's
``load_state_dict`` rebuilds containers from their items and turns a string into the text of
a generator.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from syncline.comm.sharded import pack_object, unpack_object
from syncline.errors import CheckpointError

__all__ = [
    "PLAIN",
    "check_optimizer",
    "dry_check",
    "load_optimizer",
    "names_in",
    "optimizer_entries",
    "optimizer_keys",
]

#: the scalar types a checkpoint holds exactly (``weights_only`` rebuilds each as itself)
PLAIN: tuple[type, ...] = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    torch.dtype,
    torch.device,
    torch.Size,
)
_CONTAINERS: tuple[type, ...] = (list, tuple, dict, OrderedDict, set)
_VALUES = "optim-values/"
_WHAT = (
    "a checkpoint holds tensors and plain values exactly (None, bool, int, float, complex, "
    "str, bytes, torch.dtype/device/Size, and lists, tuples, dicts and sets of them)"
)


def _not_plain(value: Any, where: str) -> str | None:
    """``WHERE is TYPE`` for the first part of ``value`` that is not plain data, else None.

    Exact types: a subclass (an ``IntEnum``, a ``numpy.float64``) would not come back as
    itself, or not at all."""
    if isinstance(value, torch.Tensor) or type(value) in PLAIN:
        return None
    if type(value) not in _CONTAINERS:
        return f"{where} is {_type_name(value)}"
    if isinstance(value, dict):
        for k, v in value.items():
            if type(k) not in PLAIN:
                return f"{where} has a key {k!r} of type {_type_name(k)}"
            found = _not_plain(v, f"{where}[{k!r}]")
            if found:
                return found
        return None
    for i, v in enumerate(value):
        found = _not_plain(v, f"{where}[{i}]")
        if found:
            return found
    return None


def _type_name(value: Any) -> str:
    kind = type(value)
    return (
        kind.__qualname__
        if kind.__module__ == "builtins"
        else f"{kind.__module__}.{kind.__qualname__}"
    )


def names_in(opt: torch.optim.Optimizer, named: dict[int, str]) -> list[str]:
    """The names of ``opt``'s parameters, in its order (``named``: id -> name)."""
    return [named[id(p)] for group in opt.param_groups for p in group["params"]]


def check_optimizer(opt: torch.optim.Optimizer, names: list[str]) -> None:
    """Refuse ``opt`` if its state or hyper-parameters hold anything but plain data.

    Raises:
        CheckpointError: naming the optimizer's class, the parameter and key, and the type.
    """
    owner = type(opt).__name__
    for group in opt.param_groups:
        for key, value in group.items():
            found = None if key == "params" else _not_plain(value, f"hyper-parameter {key!r}")
            if found:
                raise CheckpointError(f"{owner}: {found}; {_WHAT}")
    params = [p for group in opt.param_groups for p in group["params"]]
    for name, p in zip(names, params, strict=True):
        for key, value in opt.state.get(p, {}).items():
            found = _not_plain(value, f"state {name}/{key}")
            if found:
                raise CheckpointError(f"{owner}: {found}; {_WHAT}")


def _to(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor inside moved to ``device``, containers rebuilt as such."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(device)
    if isinstance(value, dict):
        return type(value)((k, _to(v, device)) for k, v in value.items())
    if type(value) in _CONTAINERS:
        return type(value)(_to(v, device) for v in value)
    return value


def optimizer_entries(opt: torch.optim.Optimizer, names: list[str]) -> dict[str, torch.Tensor]:
    """``opt``'s state and hyper-parameters as checkpoint entries (see the module docstring),
    keyed by parameter name so that any split of the model (any pipeline shape, or none)
    finds its parameters'.

    Raises:
        CheckpointError: more than one parameter group, or state that is not plain data.
    """
    check_optimizer(opt, names)
    sd = opt.state_dict()
    if len(sd["param_groups"]) != 1:
        raise CheckpointError(
            f"{type(opt).__name__} with {len(sd['param_groups'])} parameter groups; "
            "a checkpoint holds one"
        )
    out, values = {}, {}
    for i, per in sd["state"].items():
        plain = {}
        for key, value in per.items():
            if isinstance(value, torch.Tensor):
                out[f"optim/{names[i]}/{key}"] = value.detach().cpu()
            else:
                plain[key] = _to(value, torch.device("cpu"))
        if plain:
            values[names[i]] = {"keys": list(per), "values": plain}
    if values:
        out[_VALUES + names[0]] = pack_object(values)
    hyper = {k: v for k, v in sd["param_groups"][0].items() if k != "params"}
    out["optim/hparams"] = pack_object(hyper)
    return out


def optimizer_keys(index: dict[str, Any], names: list[str]) -> list[str]:
    """The entries of a checkpoint (``index``) that :func:`load_optimizer` reads for
    ``names``: every optimizer's packed values (small; a resharded run finds its
    parameters' among any of them)."""
    prefixes = tuple(f"optim/{n}/" for n in names)
    return ["optim/hparams", *(k for k in index if k.startswith((*prefixes, _VALUES)))]


def load_optimizer(
    opt: torch.optim.Optimizer, names: list[str], got: dict[str, torch.Tensor]
) -> None:
    """Load the entries ``got`` (read for :func:`optimizer_keys`) into ``opt``; each packed
    value is set as it was saved, its tensors on the parameter's device."""
    hyper = unpack_object(got["optim/hparams"], "optimizer hyper-parameters")
    values: dict[str, Any] = {}
    for key in sorted(k for k in got if k.startswith(_VALUES)):
        values.update(unpack_object(got[key], f"optimizer state {key}"))
    state = {}
    for i, name in enumerate(names):
        prefix = f"optim/{name}/"
        per = {k[len(prefix) :]: v for k, v in got.items() if k.startswith(prefix)}
        plain = values.get(name, {"keys": [], "values": {}})
        per.update(plain["values"])
        if per:  # in the saved order of keys
            state[i] = {k: per[k] for k in [*plain["keys"], *per] if k in per}
    opt.load_state_dict(
        {"state": state, "param_groups": [{**hyper, "params": list(range(len(names)))}]}
    )
    params = [p for group in opt.param_groups for p in group["params"]]
    for i, name in enumerate(names):
        for key, value in values.get(name, {"values": {}})["values"].items():
            opt.state[params[i]][key] = _to(value, params[i].device)


def dry_check(make: Callable[[list[nn.Parameter]], torch.optim.Optimizer]) -> None:
    """Build an optimizer with ``make`` on two small parameters (a matrix and a vector: an
    optimizer may treat them apart), take one step, and refuse it if its state or
    hyper-parameters could not be checkpointed exactly: before training, where a run would
    otherwise fail at its first checkpoint.

    An optimizer that cannot step on these stand-ins is left to the check of each
    checkpoint (the same check, on the real state).

    Raises:
        CheckpointError: as :func:`check_optimizer`.
    """
    params = [nn.Parameter(torch.ones(2, 2)), nn.Parameter(torch.ones(2))]
    opt = make(params)
    for p in params:
        p.grad = torch.full_like(p, 0.5)
    try:
        opt.step(lambda: 0.0)  # a closure: an optimizer such as L-BFGS needs one
    except Exception:  # not this check's verdict: each checkpoint checks the real state
        check_optimizer(opt, ["matrix", "vector"])  # its hyper-parameters, at least
        return
    check_optimizer(opt, ["matrix", "vector"])
