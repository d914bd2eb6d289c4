"""Build this rank's stages: agree on the split, cut the model, materialise the stage's
layers, join the replicas.

The split is given, or profiled on rank 0 (forward + backward time per layer on the first
micro-batch) and broadcast, so every rank cuts alike (with replicas, the first pipeline's
profile wins). A model built on the meta device is profiled one layer at a time (each a
throw-away real copy, :func:`~syncline.models.meta_init.materialized_copy`), and each rank
then materialises only its own stages' layers from per-layer seeds, so no rank ever holds
the whole model; a model split at named modules is traced on the meta device and each rank
materialises the modules of its own stages, seeded by name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from syncline import comm
from syncline.comm.device import comm_device
from syncline.errors import ConfigError
from syncline.models.meta_init import LayerInit, materialize_layers, materialized_copy
from syncline.models.meta_modules import ModuleInit, materialize_named
from syncline.partition import balance as balance_costs
from syncline.partition import check_balance, stage_bounds
from syncline.pipeline.profile import profile_layers
from syncline.pipeline.replicas import StageReplicas
from syncline.pipeline.shapes import Autocast, BoundaryShapes, infer_sequential
from syncline.pipeline.split import stage_modules
from syncline.pipeline.stage import Stage
from syncline.pipeline.trace import TracedModel, retarget, trace_model
from syncline.pipeline.traced_stage import boundary_likes, traced_stages


def profiled_split(
    module: nn.Sequential,
    sample: torch.Tensor,
    num_stages: int,
    *,
    rank: int,
    group: comm.Group,
    replicas: StageReplicas | None,
    timeout_s: float,
    seed: int,
    init: LayerInit | None,
) -> list[int]:
    """Rank 0 profiles the layers on ``sample`` (a micro-batch of stage 0's input, on the
    device the stages run on) and broadcasts the balanced split, which every rank returns.
    The split travels on the group's communication device (NCCL: CUDA); it is read on the
    host once, at setup."""
    wire = comm_device(comm.backend_name(group), sample.device)
    split = torch.zeros(num_stages, dtype=torch.int64, device=wire)
    if rank == 0:

        def real(index: int, layer: nn.Module) -> nn.Module:
            return materialized_copy(layer, index, device=sample.device, seed=seed, init=init)

        profile = profile_layers(module, sample, prepare=real)
        costs = balance_costs(profile.seconds, num_stages)
        split = torch.tensor(costs, dtype=torch.int64, device=wire)
    what = "broadcast of the profiled balance"
    comm.broadcast_tensors_async([split], src=0, group=group, what=what, timeout_s=timeout_s).wait()
    if replicas is not None:  # each pipeline profiled its own: take the first's
        replicas.agree(split, what)
    return check_balance([int(v) for v in split.tolist()], len(module), num_stages)


def build_stages(
    module: nn.Sequential,
    split: Sequence[int],
    stages: Sequence[int],
    *,
    device: torch.device,
    seed: int,
    init: LayerInit | None,
    replicas: StageReplicas | None,
    shape: Sequence[int],
    make_stage: Callable[[int, nn.Sequential], Stage],
) -> dict[int, Stage]:
    """This rank's ``stages`` of ``module`` cut by ``split``: layers on the meta device are
    materialised on ``device`` (layer ``i`` from ``layer_seed(seed, i)``); with replicas,
    after checking that they agree on the pipeline's ``shape``, every replica takes the
    first one's weights (before 2BW's weight versions are taken from them)."""
    parts = stage_modules(module, split, stages)
    bounds = stage_bounds(split)
    for s, part in parts.items():
        layers = [(bounds[s][0] + j, layer) for j, layer in enumerate(part)]
        materialize_layers(layers, device=device, seed=seed, init=init)
    moved = {s: part.to(device) for s, part in parts.items()}  # the broadcast goes from there
    if replicas is not None:
        replicas.join(dict(moved), shape)
    return {s: make_stage(s, part) for s, part in moved.items()}


def build_traced_stages(
    module: nn.Module,
    split_points: Sequence[str],
    example: object,
    stages: Sequence[int],
    *,
    device: torch.device,
    seed: int,
    init: ModuleInit | None,
    replicas: StageReplicas | None,
    shape: Sequence[int],
    make_stage: Callable[[int, nn.Module], Stage],
) -> tuple[TracedModel, dict[int, Stage]]:
    """``module`` split at ``split_points`` on ``example`` (one micro-batch, a dict of the
    model's inputs) and this rank's ``stages`` of it (:mod:`syncline.pipeline.traced_stage`)
    on ``device``; with replicas, the first one's weights (as :func:`build_stages`). A model
    on the meta device is traced on the example's shapes, and only this rank's stages are
    materialised, each module from its own seed (:mod:`syncline.models.meta_modules`).

    Raises:
        ConfigError: ``example`` is not a dict, or the trace fails (see ``trace_model``).
    """
    if not isinstance(example, dict):
        raise ConfigError(
            "a pipeline with split_points takes batches (inputs, targets) whose inputs are a "
            f"dict of the model's arguments, got {type(example).__name__}"
        )
    on_meta = any(t.is_meta for t in module.parameters())
    if on_meta:  # traced on shapes alone: no rank ever holds the whole model
        example = {
            k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in example.items()
        }
    traced = trace_model(module, split_points, example)
    if on_meta:
        for s in stages:
            part = traced.stages[s]
            materialize_named(
                part, module, traced.canonical[s], device=device, seed=seed, init=init
            )
            retarget(part, device)
    parts = {s: m.to(device) for s, m in traced_stages(traced, stages).items()}
    if replicas is not None:
        replicas.join(dict(parts), shape)
    return traced, {s: make_stage(s, part) for s, part in parts.items()}


def sequential_boundaries(
    module: nn.Sequential, split: Sequence[int], device: torch.device, autocast: Autocast
) -> BoundaryShapes:
    """The inferred messages of ``module`` cut by ``split`` (every stage, this rank's or
    not: :mod:`syncline.pipeline.shapes`), computed once per input signature."""
    parts = list(stage_modules(module, split, range(len(split))).values())
    return BoundaryShapes(lambda signature: infer_sequential(parts, signature, device, autocast))


def traced_boundaries(traced: TracedModel, precision: str) -> BoundaryShapes:
    """The messages of a traced model, fixed by its trace (whatever the input signature)."""
    likes = boundary_likes(traced, precision)
    return BoundaryShapes(lambda signature: likes)
