"""Pipeline's argument checks: every bad value fails before any work, with its name.

Kept apart from the runtime so that it reads as one list of rules (the plan checks the sizes
against the process group, :mod:`syncline.pipeline.replicas` the data-parallel group).
"""

from __future__ import annotations

import torch
from torch import nn

from syncline.comm.p2p import MAX_TAG
from syncline.errors import ConfigError
from syncline.partition import check_balance
from syncline.pipeline.config import PipelineConfig
from syncline.pipeline.links import max_tag
from syncline.pipeline.split import check_no_shared_weights


def check_device(backend: str, compute: torch.device, wire: torch.device, size: int) -> None:
    """A pipeline of several ranks sends its activations from ``compute``: ``backend`` must
    take point-to-point tensors there (its communication device ``wire``).

    gloo takes CUDA tensors for collectives (so ``wire`` may be the GPU) but has no CUDA
    send/recv: its point-to-point device is the CPU whatever the compute device.

    Raises:
        ConfigError: stages off the CPU on gloo, which sends only CPU tensors point-to-point.
    """
    p2p = torch.device("cpu") if backend == "gloo" else wire
    if size > 1 and p2p != compute:
        raise ConfigError(
            f"a pipeline of {size} ranks computing on {compute} with the {backend} backend: "
            f"{backend} sends point-to-point only {p2p} tensors; valid: nccl for CUDA stages "
            "(one GPU per rank), gloo for CPU stages"
        )


def check_args(
    module: object, config: PipelineConfig, split_points: list[str] | None = None
) -> None:
    """The checks of the module against the (self-validated) config that need no process
    group, each naming the value (the plan checks the sizes against the group)."""
    d, m = config.num_stages, config.num_microbatches
    if split_points is not None:
        _check_split_points(module, config, split_points)
    elif not isinstance(module, nn.Sequential):
        raise ConfigError(
            f"module is a {type(module).__name__}; valid: an nn.Sequential of layers, or any "
            "model with split_points=[module names] (e.g. ['transformer.h.6'])"
        )
    else:
        if d > len(module):
            raise ConfigError(
                f"num_stages={d} is more than the module's {len(module)} layers; "
                f"valid: num_stages <= {len(module)}"
            )
        if config.balance is not None:
            check_balance(list(config.balance), len(module), d)
            check_no_shared_weights(module, config.balance)  # a profiled one: once profiled
    if max_tag(d, m) > MAX_TAG:
        raise ConfigError(f"num_stages * num_microbatches={d * m} is too large for message tags")


def _check_split_points(module: object, config: PipelineConfig, points: list[str]) -> None:
    if not isinstance(module, nn.Module):
        raise ConfigError(f"module is a {type(module).__name__}; valid: an nn.Module")
    if config.num_stages != len(points) + 1:
        raise ConfigError(
            f"num_stages={config.num_stages} but split_points={points} cut the model into "
            f"{len(points) + 1} stages; valid: num_stages = len(split_points) + 1"
        )
    if config.balance is not None:
        raise ConfigError(
            f"balance={list(config.balance)} with split_points: the split points already "
            "say where the stages begin; pass one of them"
        )
    names = dict(module.named_modules())
    unknown = [p for p in points if not p or p not in names]
    if unknown or len(set(points)) != len(points):
        raise ConfigError(
            f"split_points={points}: {unknown or 'repeated names'}; valid: distinct names "
            f"from model.named_modules(), e.g. {[n for n in names if n][:4]}"
        )
    on_meta = {t.is_meta for t in [*module.parameters(), *module.buffers()]}
    if len(on_meta) > 1:
        raise ConfigError(
            f"{type(module).__name__} has tensors both on the meta device and off it; with "
            "split_points build it wholly under torch.device('meta') (each rank then "
            "materialises its stages only) or wholly on a real device"
        )


def check_callables(loss_fn: object, optimizer: object) -> None:
    if not callable(loss_fn) or not callable(optimizer):
        raise ConfigError("loss_fn and optimizer must be callables")
