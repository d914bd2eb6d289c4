"""When, and from what, one rank's stages are built: once, by the first call that needs them.

The split comes from the given ``balance``, from a balance profiled on the first micro-batch
(:func:`~syncline.pipeline.build.profiled_split`, a collective), or from a trace at the
split points on the first micro-batch (:func:`~syncline.pipeline.build.build_traced_stages`).
Building materialises the stages' layers on the device and, with replicas, communicates
(every replica checks the pipeline's shape, then takes the first replica's weights), so it
never happens in :class:`~syncline.pipeline.runtime.Pipeline`'s constructor, which only
stores and checks settings: it happens in :meth:`Pipeline.prepare`, in the first
``train_step``, ``eval_step`` or ``predict``, or in the first read of the stages
(``local_state_dict``, ``optimizers``, ...), the same on every rank.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from syncline import comm
from syncline.errors import ConfigError
from syncline.models.meta_init import LayerInit
from syncline.models.meta_modules import ModuleInit
from syncline.partition import stage_bounds
from syncline.pipeline.batches import Batch, to_device
from syncline.pipeline.build import (
    build_stages,
    build_traced_stages,
    profiled_split,
    sequential_boundaries,
    traced_boundaries,
)
from syncline.pipeline.config import PipelineConfig
from syncline.pipeline.context import PipelineContext
from syncline.pipeline.links import Signature, tied_tag
from syncline.pipeline.shapes import BoundaryShapes, Like
from syncline.pipeline.stage import Stage
from syncline.pipeline.tied import TiedGradients
from syncline.pipeline.trace import TracedModel
from syncline.schedule import Plan

#: ``make_stage(index, module)``: a stage of the pipeline's settings around ``module``
MakeStage = Callable[[int, nn.Module], Stage]


class StageSetup:
    """Builds one rank's stages into its context, once, and keeps what the build decided:
    the split (``balance``), the trace and the boundaries' inferred messages.

    Args:
        module: the whole model (``nn.Sequential``, or any model with ``split_points``).
        config: the pipeline's settings (``balance``: the given split, if any).
        split_points: module names that start a stage, or ``None``.
        plan: the pipeline's plan (which stages this rank runs, the schedule's name).
        group: the pipeline's group (a profiled balance is broadcast over it).
        timeout_s: the longest a profiled balance's broadcast may take.
        seed, init: how layers on the meta device are materialised.
        make_stage: wraps each stage's module in a :class:`~syncline.pipeline.stage.Stage`.
    """

    def __init__(
        self,
        module: nn.Module,
        config: PipelineConfig,
        *,
        split_points: list[str] | None,
        plan: Plan,
        group: comm.Group,
        timeout_s: float,
        seed: int,
        init: LayerInit | ModuleInit | None,
        make_stage: MakeStage,
    ) -> None:
        self._module = module
        self._config = config
        self._split_points = split_points
        self._plan = plan
        self._group = group
        self._timeout_s = timeout_s
        self._seed, self._init = seed, init
        self._make_stage = make_stage
        #: layers per stage: given, or profiled by the build; ``None`` for a traced model
        self.balance: list[int] | None = None if config.balance is None else list(config.balance)
        self.traced: TracedModel | None = None  # split at split_points, once built
        self.boundaries: BoundaryShapes | None = None  # inferred messages, once built
        self.built = False

    def build(self, ctx: PipelineContext, batch: Batch | None = None) -> None:
        """Build this rank's stages into ``ctx`` unless built: from the given balance, else
        on ``batch``'s first micro-batch (traced at the split points, or profiled).

        Raises:
            ConfigError: the build needs a batch (``balance=None``) and none is given.
        """
        if self.built:
            return
        if self.balance is None and batch is None:
            raise ConfigError(
                "balance=None: the split is profiled in the first train_step; call it first, "
                "or pass balance=[...]"
            )
        if self._split_points is not None:
            assert batch is not None
            self._build_traced(batch, ctx)
        elif self.balance is not None:
            self._build_sequential(self.balance, ctx)
        else:
            assert batch is not None
            self._build_sequential(self._profile(batch, ctx), ctx)

    @property
    def needs_batch(self) -> bool:
        """Whether :meth:`build` would need a batch (nothing built, no balance given)."""
        return not self.built and self.balance is None

    def infer(self, edge: int, signature: Signature) -> Like | None:
        """The inferred message of boundary ``edge`` (see :mod:`syncline.pipeline.shapes`)."""
        return None if self.boundaries is None else self.boundaries.like(edge, signature)

    def check_inputs(self, batch: Batch) -> None:
        """A traced model runs only micro-batches of the traced shape (every rank checks)."""
        if self.traced is not None:
            self.traced.check_parts(batch.inputs)

    def first_layer(self, stage: int) -> int | None:
        """The full model's index of ``stage``'s first layer (``None``: a traced model)."""
        return None if self.balance is None else stage_bounds(self.balance)[stage][0]

    def _shape(self, ctx: PipelineContext) -> list[int]:
        """What every replica of this rank's stages must agree on."""
        config, name = self._config, zlib.crc32(self._plan.name.encode())
        return [ctx.rank, self._plan.num_ranks, config.num_stages, config.num_microbatches,
                name, int(config.recompute)]  # fmt: skip

    def _profile(self, batch: Batch, ctx: PipelineContext) -> list[int]:
        """Rank 0 profiles the layers on the first micro-batch; every rank gets the split."""
        sample = batch.inputs[0]
        assert isinstance(self._module, nn.Sequential) and isinstance(sample, torch.Tensor)
        return profiled_split(
            self._module, sample.to(ctx.device), self._config.num_stages, rank=ctx.rank,
            group=self._group, replicas=ctx.replicas, timeout_s=self._timeout_s,
            seed=self._seed, init=cast(LayerInit | None, self._init),
        )  # fmt: skip

    def _build_sequential(self, split: list[int], ctx: PipelineContext) -> None:
        assert isinstance(self._module, nn.Sequential)
        ctx.stages = build_stages(
            self._module, split, self._plan.stages_of(ctx.rank), device=ctx.device,
            seed=self._seed, init=cast(LayerInit | None, self._init), replicas=ctx.replicas,
            shape=self._shape(ctx), make_stage=self._make_stage,
        )  # fmt: skip
        self.balance = split
        self.boundaries = sequential_boundaries(
            self._module, split, ctx.device, ctx.precision.autocast
        )
        self.built = True

    def _build_traced(self, batch: Batch, ctx: PipelineContext) -> None:
        """Split the model at the split points on ``batch``'s first micro-batch and build
        this rank's stages (every rank traces: stage modules cannot be pickled)."""
        assert self._split_points is not None
        example = to_device(batch.inputs[0], ctx.device)
        traced, ctx.stages = build_traced_stages(
            self._module, self._split_points, example, self._plan.stages_of(ctx.rank),
            device=ctx.device, seed=self._seed, init=cast(ModuleInit | None, self._init),
            replicas=ctx.replicas, shape=self._shape(ctx), make_stage=self._make_stage,
        )  # fmt: skip
        d = self._config.num_stages
        ctx.tied = TiedGradients(
            ctx.links.p2p, traced.tied, self._plan.schedule.rank_of,
            lambda group, batch, stage: tied_tag(d, group, batch, stage),
        )  # fmt: skip
        self.traced = traced
        self.boundaries = traced_boundaries(traced, ctx.precision.precision)
        self.built = True
