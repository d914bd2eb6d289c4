"""DistributedDataParallel's surface, as :class:`~syncline.dp.DataParallel` answers it.

Scripts written for DDP set and read its attributes, public and private (``no_sync`` by
hand through ``require_backward_grad_sync``, ``static_graph``, ``_set_static_graph()``...).
DataParallel implements those it can with DDP's meaning; every other name DDP gives a
meaning to is refused when read or set, naming what to use instead, so that a script's
setting never lands silently in the wrapper's ``__dict__`` where nothing reads it. The
names are read from torch's own DDP class (its methods, and every ``self.NAME =`` in its
source), so a new torch release's surface is covered without a list to keep.
"""

from __future__ import annotations

import ast
import copy
import functools
import inspect
import textwrap
import weakref
from typing import TYPE_CHECKING, Any

from torch import nn

from syncline.errors import ConfigError

if TYPE_CHECKING:
    from syncline.dp.engine import DataParallel

__all__ = [
    "buffer_syncs",
    "ddp_attribute_names",
    "pickled_state",
    "refusal",
    "refuse_unsupported",
    "take_over",
]

#: what to use instead of a DDP name DataParallel does not implement
ALTERNATIVES = {
    "static_graph": "DataParallel finds the graph's used parameters every step itself",
    "_set_static_graph": "DataParallel finds the graph's used parameters every step itself",
    "gradient_as_bucket_view": "DataParallel's gradients are always views of its buckets",
    "bucket_bytes_cap": "pass bucket_cap_mb= to DataParallel (or leave it to the tuner)",
    "reducer": "DataParallel's reduction is internal; see last_stats and bucket_plan",
    "logger": "see DataParallel.last_stats and bucket_tuning",
    "_get_ddp_logging_data": "see DataParallel.last_stats, bucket_plan and bucket_tuning",
    "mixed_precision": "use syncline.dp.precision (autocast, LossScaler) or compression=",
    "_register_fused_optim": "step the optimizer after backward, as usual",
    "register_comm_hook": "pass compression= (a registered compressor) to DataParallel",
}

_UNSUPPORTED = (
    "DataParallel does not support {name}={value!r} (a DistributedDataParallel option); "
    "leave it at its default ({default})"
)


@functools.cache
def ddp_attribute_names() -> frozenset[str]:
    """Every name torch's ``DistributedDataParallel`` defines beyond ``nn.Module``'s: its
    methods and properties, and the attributes its methods assign (``self.NAME = ...``)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    names = {n for n in vars(DDP) if not n.startswith("__")}
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(DDP)))
    except (OSError, TypeError):  # no source shipped: the class's own names only
        tree = None
    for node in ast.walk(tree) if tree is not None else ():
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
        ):
            names.add(node.attr)
    return frozenset(names - set(dir(nn.Module)))


def own_attribute(module: nn.Module, name: str) -> bool:
    """Whether ``name`` is the wrapper's own: in its class, its ``__dict__``, or a module,
    parameter or buffer of it (so read by its code), or set while it is still constructed
    (before ``_sync_enabled``, its last constructor attribute but few)."""
    inner = module.__dict__
    return (
        hasattr(type(module), name)
        or name in inner
        or any(name in inner.get(kind, ()) for kind in ("_modules", "_parameters", "_buffers"))
        or "_sync_enabled" not in inner
    )


def refusal(name: str) -> str:
    """The error text for a DDP name DataParallel does not implement."""
    instead = ALTERNATIVES.get(name, "see the DDP compatibility table (docs/compatibility.md)")
    return (
        f"DataParallel does not implement DistributedDataParallel's {name!r} (refused, "
        f"not ignored): {instead}"
    )


def refuse_unsupported(**given: Any) -> None:
    """DDP constructor options with no DataParallel equivalent: refused, never ignored."""
    for name, value in given.items():
        if value is not None:
            default = "False" if name == "skip_all_reduce_unused_params" else "None"
            raise ConfigError(_UNSUPPORTED.format(name=name, value=value, default=default))


def pickled_state(dp: DataParallel) -> dict[str, Any]:
    """What pickling (and deepcopy) of a DataParallel keep: what DDP's do, the module and the
    settings; loaded, the wrapper is built again on the default group, with no broadcast. A
    group, a collective object or a compressor's state would not come back: refused."""
    args = dp._settings
    if args["process_group"] is not None or not isinstance(args["allreduce"], str):
        why = "its process group or collective does not survive pickling"
    elif not dp._compressor.stateless:
        why = f"its compressor {dp._compressor.name!r} keeps state a pickle would lose"
    elif dp._sync.periodic:
        why = f"its sync={dp._sync.strategy.name!r} keeps state a pickle would lose"
    else:
        dp.remove_hooks()
        try:
            module = copy.deepcopy(dp.module)
        finally:
            dp.install_hooks()
        return {
            "module": module,
            "settings": {**args, "init_sync": False},
            "train": dp.training,
        }
    hint = (
        "save model.module.state_dict() (and compression_state_dict(), sync.state_dict()) instead"
    )
    raise ConfigError(f"DataParallel cannot be pickled or deep-copied: {why}; {hint}")


def buffer_syncs(
    forward_sync_buffers: bool | None, broadcast_buffers: bool | None
) -> tuple[bool, bool]:
    """(buffers synced before forwards, buffers in the initial broadcast), as DDP 2.13 reads
    its switches: ``forward_sync_buffers`` replaces ``broadcast_buffers``; only the deprecated
    ``broadcast_buffers=False`` also leaves the buffers out of the initial broadcast."""
    if forward_sync_buffers is not None:
        return bool(forward_sync_buffers), True
    return broadcast_buffers is not False, broadcast_buffers is not False


# [Note: one live wrapper per module] A second DataParallel of a module takes over: the
# previous wrapper's hooks are removed and it refuses to run. Refusing the second one instead
# would break the commonest re-wrap, ``dp = DataParallel(net)`` run again (a notebook cell, a
# retry loop), where the old wrapper is still referenced by ``dp`` while the new one is built.
_OWNER: weakref.WeakKeyDictionary[nn.Module, weakref.ReferenceType[DataParallel]] = (
    weakref.WeakKeyDictionary()
)


def take_over(module: nn.Module, wrapper: DataParallel) -> None:
    """Make ``wrapper`` the live wrapper of ``module``, superseding the previous one."""
    previous = _OWNER.get(module)
    old = previous() if previous is not None else None
    if old is not None and old is not wrapper:
        old._supersede()
    _OWNER[module] = weakref.ref(wrapper)
