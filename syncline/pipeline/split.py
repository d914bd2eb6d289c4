"""Cut an ``nn.Sequential`` into stage modules by a balance (layers per stage).

A stage module shares the layer objects of the user's model (no copy), so the full model
built on every rank stays the one source of the weights. A parameter reachable from two
stages (tied embedding and output head) would get two gradients on two ranks and drift
apart, so it is refused with the names of both uses.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from syncline.errors import ConfigError
from syncline.partition import stage_bounds


def check_no_shared_weights(module: nn.Sequential, split: Sequence[int]) -> None:
    """Raise ``ConfigError`` if one parameter is used by layers of two stages."""
    owner: dict[int, tuple[int, str]] = {}
    for s, (lo, hi) in enumerate(stage_bounds(split)):
        for i in range(lo, hi):
            for name, p in module[i].named_parameters():
                first_stage, first_name = owner.setdefault(id(p), (s, f"{i}.{name}"))
                if first_stage != s:
                    raise ConfigError(
                        f"parameter {first_name} (stage {first_stage}) is also {i}.{name} on "
                        f"stage {s}; weights shared across stages are not supported, choose a "
                        "balance that keeps them on one stage"
                    )


def stage_modules(
    module: nn.Sequential, split: Sequence[int], stages: Sequence[int]
) -> dict[int, nn.Sequential]:
    """``{stage: nn.Sequential of its layers}`` for the given ``stages``.

    Raises:
        ConfigError: a parameter is shared across stages.
    """
    check_no_shared_weights(module, split)
    bounds = stage_bounds(split)
    return {s: nn.Sequential(*[module[i] for i in range(*bounds[s])]) for s in stages}


def full_state(module: nn.Module, first_layer: int | None) -> dict[str, torch.Tensor]:
    """A stage's ``state_dict(keep_vars=True)`` under the full model's names: its layer ``i``
    is the model's layer ``first_layer + i`` (checkpoints and resharding key state by
    these names, so they do not depend on the split). ``first_layer=None``: a traced stage,
    whose names are the model's under ``stage.``."""
    out = {}
    for key, value in module.state_dict(keep_vars=True).items():
        if first_layer is None:
            out[key.removeprefix("stage.")] = value
            continue
        index, rest = key.split(".", 1)
        out[f"{first_layer + int(index)}.{rest}"] = value
    return out
