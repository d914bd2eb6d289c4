"""PURE: the optimizer registry: what ``optimizer=NAME`` (``--optimizer``) builds.

An entry says how to build the optimizer from the run's learning rate, momentum and weight
decay, and what the rest of syncline must know of it: whether it takes SGD-style momentum
(which moves into a compressor that applies momentum itself, CSC's momentum correction) and
whether it keeps a first moment of its own (then such a compressor's momentum would be
applied twice, which the config refuses). Adding an optimizer is one
``OPTIMIZERS.register(OptimizerSpec(...))``, in syncline or in a plug-in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from syncline.registry import Registry, resolve

__all__ = ["OPTIMIZERS", "OptimizerSpec", "build_optimizer"]


@dataclass(frozen=True)
class OptimizerSpec:
    """One optimizer as ``syncline train`` sees it.

    Attributes:
        name: what ``optimizer=`` and ``--optimizer`` take.
        summary: one line for ``--help``.
        factory: the optimizer class (or ``"module:Class"``), called as
            ``factory(params, lr=..., weight_decay=...)`` plus ``momentum=...`` when it
            ``takes_momentum``.
        takes_momentum: SGD-style momentum, set from ``momentum`` (0 beside a compressor
            that applies momentum itself).
        adaptive: keeps a first moment of its own (Adam-like), so a compressor's momentum
            beside it would be momentum twice.
        state_buffers: parameter-sized buffers of state it keeps (Adam: 2 moments; SGD:
            the momentum, none when that moved into the compressor), for the planner.
    """

    name: str
    summary: str
    factory: str | Callable[..., Any]
    takes_momentum: bool = False
    adaptive: bool = False
    state_buffers: int = 0


OPTIMIZERS: Registry[OptimizerSpec] = Registry("optimizer")


def build_optimizer(
    name: str, params: Any, *, lr: float, momentum: float, weight_decay: float
) -> Any:
    """The registered optimizer ``name`` over ``params``.

    Raises:
        ConfigError: an unknown name, listing the valid ones.
    """
    spec = OPTIMIZERS.get(name)
    kwargs: dict[str, Any] = {"lr": lr, "weight_decay": weight_decay}
    if spec.takes_momentum:
        kwargs["momentum"] = momentum
    return resolve(spec.factory)(params, **kwargs)


OPTIMIZERS.register(
    OptimizerSpec(
        "adamw",
        "Adam with decoupled weight decay",
        "torch.optim:AdamW",
        adaptive=True,
        state_buffers=2,
    )
)
OPTIMIZERS.register(
    OptimizerSpec(
        "sgd", "SGD with momentum", "torch.optim:SGD", takes_momentum=True, state_buffers=1
    )
)
OPTIMIZERS.register(
    OptimizerSpec(
        "lars",
        "SGD with layer-wise trust ratios (You et al. 2017)",
        "syncline.optim.lars:Lars",
        takes_momentum=True,
        state_buffers=1,
    )
)
OPTIMIZERS.register(
    OptimizerSpec(
        "lamb",
        "Adam with layer-wise trust ratios (You et al. 2019)",
        "syncline.optim.lamb:Lamb",
        adaptive=True,
        state_buffers=2,
    )
)
