"""Pipeline's argument checks: every bad value fails before any work, with its name.

Kept apart from the runtime so that it reads as one list of rules (the plan checks the sizes
against the process group, :mod:`syncline.pipeline.replicas` the data-parallel group).
"""

from __future__ import annotations

from torch import nn

from syncline.comm.p2p import MAX_TAG
from syncline.errors import ConfigError
from syncline.partition import check_balance
from syncline.pipeline.config import PipelineConfig
from syncline.pipeline.links import max_tag


def check_args(module: object, config: PipelineConfig) -> None:
    """The checks of the module against the (self-validated) config that need no process
    group, each naming the value (the plan checks the sizes against the group)."""
    if not isinstance(module, nn.Sequential):
        raise ConfigError(f"module is a {type(module).__name__}; valid: an nn.Sequential of layers")
    d, m = config.num_stages, config.num_microbatches
    if d > len(module):
        raise ConfigError(
            f"num_stages={d} is more than the module's {len(module)} layers; "
            f"valid: num_stages <= {len(module)}"
        )
    if config.balance is not None:
        check_balance(list(config.balance), len(module), d)
    if max_tag(d, m) > MAX_TAG:
        raise ConfigError(f"num_stages * num_microbatches={d * m} is too large for message tags")


def check_callables(loss_fn: object, optimizer: object) -> None:
    if not callable(loss_fn) or not callable(optimizer):
        raise ConfigError("loss_fn and optimizer must be callables")
