"""Pipeline's argument checks: every bad value fails before any work, with its name.

Kept apart from the runtime so that it reads as one list of rules (the plan checks the sizes
against the process group, :mod:`syncline.pipeline.replicas` the data-parallel group).
"""

from __future__ import annotations

from torch import nn

from syncline.comm.p2p import MAX_TAG
from syncline.errors import ConfigError
from syncline.partition import check_balance
from syncline.pipeline.links import max_tag
from syncline.pipeline.plan import SCHEDULES


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} is invalid; valid: an int >= 1")
    return value


def check_args(
    module: object,
    num_stages: int,
    num_microbatches: int,
    schedule: str,
    balance: list[int] | None,
    timeout_s: float,
) -> None:
    """The checks that need no process group, each naming the value (the plan checks the
    sizes against the group)."""
    if not isinstance(module, nn.Sequential):
        raise ConfigError(f"module is a {type(module).__name__}; valid: an nn.Sequential of layers")
    d = _check_int("num_stages", num_stages)
    m = _check_int("num_microbatches", num_microbatches)
    if schedule not in SCHEDULES:
        raise ConfigError(f"schedule={schedule!r} is unknown; valid: {', '.join(SCHEDULES)}")
    if d > len(module):
        raise ConfigError(
            f"num_stages={d} is more than the module's {len(module)} layers; "
            f"valid: num_stages <= {len(module)}"
        )
    if schedule == "2bw" and m < d:
        raise ConfigError(
            f"num_microbatches={m} must be >= num_stages={d} for 2bw (stage 0 would need a "
            "weight version not made yet)"
        )
    if balance is not None:
        check_balance(balance, len(module), d)
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or timeout_s <= 0:
        raise ConfigError(f"timeout_s={timeout_s!r} is invalid; valid: seconds > 0")
    if max_tag(d, m) > MAX_TAG:
        raise ConfigError(f"num_stages * num_microbatches={d * m} is too large for message tags")


def check_callables(loss_fn: object, optimizer: object, recompute: object) -> None:
    if not callable(loss_fn) or not callable(optimizer):
        raise ConfigError("loss_fn and optimizer must be callables")
    if not isinstance(recompute, bool):
        raise ConfigError(f"recompute={recompute!r} is invalid; valid: True or False")
