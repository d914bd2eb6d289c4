"""What the data-parallel and the pipeline training loops share: model, data, optimizer, lr.

Kept apart so that both loops build the same model from the same seed and follow the same
learning-rate schedule, and neither imports the other's engine.
"""

from __future__ import annotations

import errno
import inspect
import math
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from syncline.comm.device import local_device, peak_memory_bytes
from syncline.data.heldout import holdout
from syncline.data.registry import build_dataset as build_registered_dataset
from syncline.dp.compression import Compressor
from syncline.errors import ConfigError
from syncline.launch.devices import device_kind, resolved_backend
from syncline.models.meta_init import LayerInit, materialize
from syncline.optim.registry import build_optimizer
from syncline.registry import resolve
from syncline.train.config import TrainConfig


def rank_backend_and_device(cfg: TrainConfig, local_rank: int) -> tuple[str, torch.device]:
    """The backend and the device of the rank with ``local_rank`` on its node, made its
    current CUDA device: ``auto`` is NCCL on a GPU node; under NCCL the rank computes on
    ``cuda:(local_rank % visible GPUs)`` (a scheduler that gives each rank one visible GPU
    makes ``cuda:local_rank`` invalid for every rank but the first), under gloo on the CPU.

    Raises:
        ConfigError: backend nccl on a node without a visible GPU.
    """
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = resolved_backend(cfg.backend, gpus)
    device = local_device(device_kind(backend), local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's communicators and the caching allocator
    return backend, device


def rank_memory(device: torch.device) -> dict[str, Any]:
    """This rank's peak memory so far: on its device (:func:`peak_memory_bytes`:
    ``torch.cuda.max_memory_allocated`` on a GPU, the resident set on the CPU) and the
    process's resident set, which the CPU-era summaries reported."""
    peak = peak_memory_bytes(device)
    rss = peak if peak.kind == "rss" else peak_memory_bytes(torch.device("cpu"))
    return {
        "kind": peak.kind,
        "bytes": peak.bytes,
        "reserved_bytes": peak.reserved_bytes,
        "rss_bytes": rss.bytes,
    }


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up (Goyal et al. 2017), then cosine decay to 10 % of the peak
    (``cfg.peak_lr``: ``lr`` scaled to the batch by ``lr_scaling``)."""
    peak = cfg.peak_lr
    if step < cfg.optim.warmup_steps:
        return peak * (step + 1) / cfg.optim.warmup_steps
    span = max(1, cfg.steps - cfg.optim.warmup_steps)
    progress = min(1.0, (step - cfg.optim.warmup_steps) / span)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def build_model_for(cfg: TrainConfig, *, meta: bool = False) -> nn.Module:
    """The configured model (from its registry entry), initialised from ``cfg.seed``.

    A model with a per-layer initialiser (:func:`layer_init_for`; the built-in ones) is
    built on the meta device; ``meta`` leaves it there (a pipeline materialises only its
    stages), otherwise it is materialised here layer by layer from the same per-layer seeds,
    so every parallel layout starts from the same weights. Without one, the builder runs
    after ``torch.manual_seed(cfg.seed)`` and ``meta`` is ignored.
    """
    build = resolve(cfg.model_spec.build)
    init = layer_init_for(cfg)
    if init is None:
        torch.manual_seed(cfg.seed)
        return build(cfg.model_config())
    with torch.device("meta"):
        model: nn.Module = build(cfg.model_config())
    if not meta:
        if not isinstance(model, nn.Sequential):
            raise ConfigError(
                f"model {cfg.model!r} has a per-layer init but built a "
                f"{type(model).__name__}; valid: an nn.Sequential (its layers are initialised)"
            )
        materialize(model, seed=cfg.seed, init=init)
    return model


def layer_init_for(cfg: TrainConfig) -> LayerInit | None:
    """The model's per-layer initialiser for ``cfg``'s shape, if its registry entry has one."""
    spec = cfg.model_spec
    return None if spec.init is None else resolve(spec.init)(cfg.model_config())


def loss_for(cfg: TrainConfig) -> Callable[[Any, Any], Any]:
    """The model's loss ``loss(output, target) -> scalar``: its registry entry's, or a
    factory's own (:mod:`syncline.models.factory`)."""
    return cfg.model_spec.loss_for(cfg.model_config())


def build_dataset(cfg: TrainConfig) -> tuple[Any, int]:
    """The configured data set's training part and the tokens per sample (1 for images)."""
    train, _, tokens = build_datasets(cfg)
    return train, tokens


def build_datasets(cfg: TrainConfig) -> tuple[Any, Any | None, int]:
    """``(train, validation, tokens per sample)``: the configured data set with its last
    ``cfg.val_fraction`` held out (``None`` when nothing is)."""
    dataset, tokens = build_registered_dataset(cfg.dataset, cfg.seq_len, cfg.seed)
    train, val = holdout(dataset, cfg.val_fraction)
    return train, val, tokens


def make_optimizer(
    cfg: TrainConfig, params: list[nn.Parameter], compressor: Compressor | None = None
) -> torch.optim.Optimizer:
    """The configured optimizer; SGD's momentum moves into the compressor when it applies
    momentum itself (CSC).

    CSC applies momentum *before* sparsification (momentum correction, Lin et al. 2018), so
    the optimizer must not apply it a second time.
    """
    momentum = 0.0 if compressor is not None and cfg.dp.owns_momentum else cfg.optim.momentum
    opt: torch.optim.Optimizer = build_optimizer(
        cfg.optim.optimizer,
        params,
        lr=cfg.peak_lr,
        momentum=momentum,
        weight_decay=cfg.optim.weight_decay,
    )
    if cfg.guard.on and "fused" in opt.defaults and not opt.defaults["fused"]:
        # the guard drops an update through the fused kernels' found_inf, with no copy
        # (syncline.optim.skip); the same hyper-parameters otherwise
        takes = inspect.signature(type(opt)).parameters
        settings = {k: v for k, v in opt.defaults.items() if k in takes}
        opt = type(opt)(params, **{**settings, "fused": True, "foreach": None})
    return opt


def set_lr(optimizers: list[torch.optim.Optimizer], lr: float) -> None:
    """Set the learning rate of every parameter group of ``optimizers``."""
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = lr


def fail_if_injected(
    cfg: TrainConfig, rank: int, step: int, attempt: int = 0, phase: str = "start"
) -> None:
    """Fail this rank where ``--inject-failure`` says, in the first attempt only (a testing
    aid: the job must stop cleanly and name the rank, or, with ``--max-restarts``, restart
    and complete): ``start`` exits with code 17, ``nospace`` raises the ``OSError`` of a
    full disk, the other phases die by SIGKILL, as a machine that loses power, with no
    chance to say goodbye."""
    if attempt != 0 or cfg.failure_point() != (rank, step, phase):
        return
    print(f"rank {rank}: injected failure at step {step} ({phase})", file=sys.stderr, flush=True)
    if phase == "nospace":  # the checkpoint writer's own error on a full disk
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (injected)")
    if phase == "start":
        os._exit(17)
    os.kill(os.getpid(), signal.SIGKILL)


def arm_failure(
    cfg: TrainConfig,
    rank: int,
    step: int,
    attempt: int,
    model: nn.Module,
    *,
    per_layer: bool = False,
) -> list[Any]:
    """Hooks that make ``fail_if_injected`` strike inside this step's forward or backward
    (``forward``, ``allreduce`` phases); remove them after the step. ``per_layer``: hook
    every layer (a pipeline runs only its stages' layers, never the whole model's forward)."""
    point = cfg.failure_point()
    if attempt != 0 or point is None or point[:2] != (rank, step):
        return []
    if point[2] == "forward":
        layers = list(model.children()) if per_layer else [model]
        return [
            layer.register_forward_pre_hook(
                lambda *_: fail_if_injected(cfg, rank, step, attempt, "forward")
            )
            for layer in layers
        ]
    if point[2] == "allreduce" and per_layer:  # die in the stage's backward: its replicas
        # go on to the REDUCE of that batch and wait there for this rank
        def on_output(_m: nn.Module, _i: Any, out: Any) -> None:
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda g: fail_if_injected(cfg, rank, step, attempt, "allreduce"))

        return [layer.register_forward_hook(on_output) for layer in model.children()]
    if point[2] == "allreduce":  # the first parameter's gradient comes last in backward
        first = next(p for p in model.parameters() if p.requires_grad)
        return [
            first.register_hook(lambda g: fail_if_injected(cfg, rank, step, attempt, "allreduce"))
        ]
    return []
