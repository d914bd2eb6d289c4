"""The pipeline runtime: executes this rank's slice of a generated schedule, action by action.

A ``train_step`` call picks the slice (:mod:`syncline.schedule.plan`), relabels it with the
global batch number and runs each action through one handler per ``ActionKind``; the order
is the generator's, never re-derived here. Each action is timed for :meth:`Pipeline.trace`.
Any failure is re-raised naming the rank, the stage, the step (global batch) and the
action; a peer that waits on a failed rank gets a connection error or times out after
``timeout_s``, naming its own rank, step and action, so no rank hangs. After a failure the
pipeline refuses further calls (its stages are mid-batch); build a new one.

Messages go through :class:`~syncline.pipeline.links.Links` (shapes, tags; on gloo receives
posted early, on NCCL each run of SEND/RECV actions issued as one group, the shapes inferred
by :mod:`syncline.pipeline.shapes`). Sends are asynchronous; a call waits at its end for the
sends of earlier calls (a 2BW call sends the next batch's first activations, which the next
stage receives in its next call), then broadcasts the batch loss from the last stage, which
every rank returns. The loss stays on the device (``train_step(..., return_tensor=True)``);
only the float that ``train_step`` returns by default is read on the host.

Data-parallel replicas (PipeDream-2BW's width): with a ``data_parallel_group`` of ``w`` ranks,
``w`` such pipelines train on their own shards, and each stage's REDUCE action averages its
gradient with its replicas before the STEP (:mod:`syncline.pipeline.replicas`); the last
stages average the batch loss before broadcasting it, so every rank returns the global mean.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, cast, overload

import torch
from torch import nn

from syncline import comm
from syncline.comm.device import comm_device
from syncline.comm.p2p import PointToPoint
from syncline.dp.compression import Compressor
from syncline.dp.precision import LossScaler
from syncline.errors import CommError, ConfigError
from syncline.models.meta_init import LayerInit
from syncline.models.meta_modules import ModuleInit
from syncline.partition import stage_bounds
from syncline.pipeline.batches import Batch, Inputs, split_inputs, take_batch, to_device
from syncline.pipeline.build import (
    build_stages,
    build_traced_stages,
    profiled_split,
    sequential_boundaries,
    traced_boundaries,
)
from syncline.pipeline.calls import CallRunner, StageError
from syncline.pipeline.checks import check_args, check_callables, check_device
from syncline.pipeline.config import DEFAULT_SCHEDULE, PipelineConfig
from syncline.pipeline.evaluate import ForwardOnly
from syncline.pipeline.links import Links, tied_tag
from syncline.pipeline.precision import PipelinePrecision
from syncline.pipeline.replicas import StageReplicas, check_compression, check_groups
from syncline.pipeline.reports import PipelineReports
from syncline.pipeline.shapes import BoundaryShapes
from syncline.pipeline.split import full_state
from syncline.pipeline.stage import LossFn, OptimizerFactory, Stage
from syncline.pipeline.tied import TiedGradients
from syncline.pipeline.timing import ActionClock
from syncline.pipeline.trace import TracedModel
from syncline.schedule import (
    SCHEDULES,
    Action,
    ActionKind,
    Plan,
    build_plan,
)
from syncline.schedule.nccl import nccl_plan

K = ActionKind
Batches = Iterator[tuple[Any, torch.Tensor]]


class Pipeline(CallRunner, PipelineReports):
    """Pipeline-parallel training of an ``nn.Sequential``, or of any model split at named
    modules: one rank per stage, optionally times ``w`` data-parallel replicas of the whole
    pipeline.

    Every rank builds the same model, on the meta device (``init``; no memory until each
    rank materialises its own stages) or whole with the same seed, and constructs the same
    ``Pipeline``; each keeps and trains only its stage's layers. Under 2BW, call
    :meth:`flush` before changing weights from outside (loading a checkpoint): an older
    version may be in use.

    Args:
        module: the model, a sequence of one-tensor-to-one-tensor layers; or, with
            ``split_points``, any model ``torch.export`` can trace (a HuggingFace GPT-2, a
            ResNet), called as ``module(**inputs)``.
        split_points: module names, e.g. ``["transformer.h.6"]``, each starting a stage
            (``num_stages = len(split_points) + 1``): the model is split there by
            torch.distributed.pipelining's tracer (:mod:`syncline.pipeline.trace`) on the
            first micro-batch of the first ``train_step``, on every rank. Batches are then
            ``(inputs, targets)`` with ``inputs`` a dict of the model's arguments (an
            attention mask reaches every stage that reads it); every micro-batch must have
            the traced shape. Any values may cross a split (several, of any dtype);
            weights shared across stages (GPT-2's tied embedding and head) keep a copy on
            each stage with their gradients summed before every step
            (:mod:`syncline.pipeline.tied`). ``balance`` does not apply; ``init``: below.
        num_stages: pipeline depth; the group's size (interleaved: a multiple >= 2 of it,
            ``num_stages // size`` stages per rank).
        num_microbatches: m, micro-batches per batch (2BW: m >= num_stages).
        schedule: ``"gpipe"``, ``"1f1b"`` (PipeDream-Flush), ``"2bw"`` (PipeDream-2BW: no
            flushes, two weight versions, ``W(t+1) = W(t) - lr*grad f(W(t-1))``) or
            ``"interleaved"`` (Megatron virtual stages).
        loss_fn: ``loss_fn(output, target) -> scalar``, the mean over a micro-batch.
        optimizer: factory, called with each local stage's parameters.
        recompute: keep only stage inputs and recompute each forward before its backward.
        balance: layers per stage; ``None`` profiles each layer's forward + backward time on
            rank 0 on the first micro-batch of the first ``train_step`` and balances that.
        process_group: the pipeline's group (``None``: the default group); stage ``s`` runs
            on its rank ``s % size``.
        data_parallel_group: this rank's replicas, one in each other pipeline (``None``: no
            replicas); both groups from :func:`syncline.comm.build_pipeline_groups`. Each
            pipeline trains on its own batches (give each replica its shard); REDUCE
            averages every stage's gradient over its replicas, and ``train_step`` returns
            the loss averaged over them. Construction broadcasts each stage's weights from
            its first replica (a collective over the group, as DDP's), once the balance is
            known; buffers (BatchNorm statistics) are not averaged afterwards.
        compression: a :class:`~syncline.dp.Compressor` for the REDUCE (default lossless;
            e.g. ``FP16()``, ``CSC(0.01)``). Unused without replicas.
        reduce_bucket_mb: the REDUCE's bucket size in MiB (``0``: one bucket per stage); each
            bucket starts inside the batch's last backward of its stage, once its gradients
            are final (:mod:`syncline.pipeline.reduce_buckets`).
        replica_allreduce: the REDUCE's collective over ``data_parallel_group`` (default a
            flat ring), e.g. ``build_allreduce("hierarchical", dp_group, timeout_s=...,
            ranks_per_node=k)`` when a stage's replicas span nodes.
        timeout_s: the longest any wait on another rank may take (under NCCL the process
            group's own timeout bounds the point-to-point waits, which do not block the host).
        device: where the stage runs; default: where the module's parameters are. A
            pipeline of several ranks on CUDA needs NCCL (gloo sends only CPU tensors).
        init: ``init(index, layer)`` for a model built on the meta device: each rank
            materialises only its stages' layers, layer ``index`` of the full model from
            its own seed (:mod:`syncline.models.meta_init`; default ``reset_parameters``),
            so the weights do not depend on the split. Layers not on the meta device keep
            their values. With ``split_points``: ``init(name, module)`` per module, seeded
            by name (:mod:`syncline.models.meta_modules`; HF: ``model._init_weights``).
        seed: the run's seed for that (``materialize(model, seed=...)`` gives the same
            full model in one process).
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"`` (autocast; fp16 loss-scaled, every
            stage and replica skipping the same steps: :mod:`syncline.pipeline.precision`).
        track_memory: measure stashed activations for :meth:`memory_stats` with autograd
            saved-tensor hooks. Off by default, as a profiler would be: a Python hook per
            saved tensor costs a few per cent of a small model's step on CPU; without it
            :meth:`memory_stats` counts only the stage inputs and outputs the pipeline holds.

    Raises:
        ConfigError: before any work or communication, naming the bad value (with replicas:
            also when they were built with different shapes, found by the first collective).

    Example:
        >>> pipe = Pipeline(model, num_stages=2, num_microbatches=4, schedule="1f1b",
        ...                 loss_fn=lm_loss, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
        >>> batches = iter(loader)           # the same batches on every rank
        >>> loss = pipe.train_step(batches)  # every rank gets the batch's mean loss
        >>> pipe.flush()                     # 2BW: finish the batch started early
        >>> pipe_group, dp_group = build_pipeline_groups(2)   # 4 ranks: 2 stages x 2 replicas
        >>> pipe = Pipeline(model, num_stages=2, num_microbatches=4, loss_fn=lm_loss,
        ...                 optimizer=opt, process_group=pipe_group,
        ...                 data_parallel_group=dp_group, compression=FP16())
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        num_stages: int,
        num_microbatches: int,
        schedule: str = DEFAULT_SCHEDULE,
        loss_fn: LossFn,
        optimizer: OptimizerFactory,
        recompute: bool = False,
        balance: list[int] | None = None,
        process_group: comm.Group = None,
        timeout_s: float = 300.0,
        device: torch.device | str | None = None,
        track_memory: bool = False,
        data_parallel_group: comm.Group = None,
        compression: Compressor | None = None,
        init: LayerInit | ModuleInit | None = None,
        seed: int = 0,
        split_points: Sequence[str] | None = None,
        precision: str = "fp32",
        reduce_bucket_mb: float = 4.0,
        replica_allreduce: comm.Collective | None = None,
    ) -> None:
        config = PipelineConfig(
            num_stages=num_stages,
            num_microbatches=num_microbatches,
            schedule=schedule,
            recompute=recompute,
            balance=tuple(balance) if isinstance(balance, list | tuple) else balance,
            timeout_s=timeout_s,
            precision=precision,
            reduce_bucket_mb=reduce_bucket_mb,
        )
        self._split_points = None if split_points is None else list(split_points)
        check_args(module, config, self._split_points)
        check_callables(loss_fn, optimizer)
        self.config = config
        self._compression = check_compression(compression)
        width = (
            1 if data_parallel_group is None else check_groups(process_group, data_parallel_group)
        )
        self._d, self._m = num_stages, num_microbatches
        size = comm.group_size(process_group)
        self._plan: Plan = build_plan(
            schedule, size, num_stages, num_microbatches, recompute=recompute
        )
        self._module = module
        self._loss_fn, self._optimizer = loss_fn, optimizer
        self._recompute = recompute
        self._track_memory = bool(track_memory)
        self._group = process_group
        self._rank = comm.group_rank(process_group)
        self._timeout_s = float(timeout_s)
        self._init, self._seed = init, seed
        first = next(module.parameters(), None)
        default = first.device if first is not None and not first.is_meta else torch.device("cpu")
        self._device = torch.device(device) if device is not None else default
        backend = comm.backend_name(process_group)
        if backend != "gloo":  # the order NCCL cannot deadlock on (syncline.schedule.nccl)
            self._plan = nccl_plan(self._plan)
        wire = comm_device(backend, self._device)
        check_device(backend, self._device, wire, size)
        dp = [data_parallel_group] if width > 1 else []
        self._precision = PipelinePrecision(precision, [process_group, *dp], self._timeout_s,
            self._device, self._compression if dp else None)  # fmt: skip
        unscale = self._precision.unscale_bucket if self._precision.in_reduce else None
        self._replicas = (
            StageReplicas(data_parallel_group, self._compression, self._timeout_s,
                          num_stages=num_stages, bucket_cap_mb=reduce_bucket_mb,
                          allreduce=replica_allreduce, prepare=unscale, device=self._device)
            if width > 1
            else None
        )  # fmt: skip
        self._last_rank = self._plan.schedule.rank_of(num_stages - 1)
        self._stages: dict[int, Stage] = {}
        self._balance: list[int] | None = None
        self._traced: TracedModel | None = None  # split at split_points, once set up
        self._tied: TiedGradients | None = None
        self._next_batch = 0  # global index of the next batch taken from the iterator
        self._evals = 0  # forward-only passes so far (they number their messages)
        self._queued: Batch | None = None  # taken, no work done yet
        self._in_flight: Batch | None = None  # 2BW: taken, first forwards done
        self._batches: dict[int, Batch] = {}
        self._inbox: dict[tuple[ActionKind, int, int, int], torch.Tensor] = {}
        self._final: set[Action] = set()  # this call's backwards that arm a REDUCE
        self._boundaries: BoundaryShapes | None = None  # inferred shapes, once set up
        self._links = Links(
            PointToPoint(process_group, timeout_s=self._timeout_s, device=wire),
            self._plan.schedule,
            num_microbatches,
            early=backend == "gloo",
            grouped=backend != "gloo",
            signature=self._signature,
            infer=self._infer,
        )
        self._connected = backend == "gloo"  # NCCL: one collective before the first group
        self._ahead: dict[str, list[tuple[int, ActionKind, int, int]]] = {}
        self._clock = ActionClock(self._device, self._rank)
        self._broken: str | None = None
        self._call = 0
        self._handlers: dict[ActionKind, Callable[[Action], None]] = {
            K.RECV_F: self._recv,
            K.RECV_B: self._recv,
            K.FORWARD: self._forward,
            K.SEND_F: self._send,
            K.RECOMPUTE: self._recompute_action,
            K.BACKWARD: self._backward,
            K.SEND_B: self._send,
            K.REDUCE: self._reduce,
            K.STEP: self._step,
        }
        if balance is not None:
            self._setup(list(balance))

    @property
    def _ready(self) -> bool:
        return self._balance is not None or self._traced is not None

    # -- public ------------------------------------------------------------------------------

    @property
    def plan(self) -> Plan:
        """The schedule and the slices each call runs."""
        return self._plan

    @property
    def balance(self) -> list[int]:
        """Layers per stage (after the first ``train_step`` when it was profiled)."""
        self._require_setup()
        if self._balance is None:
            raise ConfigError("a pipeline split at split_points has no balance")
        return list(self._balance)

    @property
    def stages(self) -> list[int]:
        """The stages this rank runs."""
        return self._plan.stages_of(self._rank)

    @property
    def stage_module(self) -> nn.Module:
        """This rank's layers with the newest weights (interleaved: an ``nn.ModuleList``)."""
        self._require_setup()
        mods = [self._stages[s].module for s in self.stages]
        return mods[0] if len(mods) == 1 else nn.ModuleList(mods)

    def local_state_dict(self, *, keep_vars: bool = False) -> dict[str, torch.Tensor]:
        """This rank's layers' newest weights and buffers, named as in the full module.

        The union over all ranks is ``module.state_dict()`` of the trained model (detached
        copies, or with ``keep_vars`` the live tensors; tied weights under each name).
        """
        self._require_setup()
        out = {}
        for s in self.stages:
            out.update(self._full_state(s))
        return out if keep_vars else {k: v.detach().clone() for k, v in out.items()}

    def _full_state(self, s: int) -> dict[str, torch.Tensor]:
        first = None if self._balance is None else stage_bounds(self._balance)[s][0]
        return full_state(self._stages[s].module, first)

    def load_local_state_dict(self, state: dict[str, torch.Tensor], next_batch: int) -> None:
        """Resume from a checkpoint: this rank's layers take their weights and buffers from
        ``state`` (named as in the full module, as :meth:`local_state_dict` gives them), and
        the batches taken from now on are numbered from ``next_batch``. Under 2BW the loaded
        weights become the one version held, numbered ``next_batch`` (a checkpoint is taken
        after a flush, when no older version is in use).

        Raises:
            ConfigError: work is in flight, or ``state`` lacks one of this rank's tensors.
        """
        self._require_setup()
        if self._in_flight is not None or self._queued is not None:
            raise ConfigError("load_local_state_dict: a batch is in flight; flush() first")
        self.flush()  # 2BW: drop the older version, so that only the loaded one is held
        missing = sorted(set(self.local_state_dict(keep_vars=True)) - set(state))
        if missing:
            raise ConfigError(f"load_local_state_dict: no value for {missing[:5]}")
        for s in self.stages:
            self._stages[s].load_state(state, list(self._full_state(s)), next_batch)
        self._next_batch = next_batch

    @property
    def compression(self) -> Compressor:
        """The REDUCE's compressor (its ``state_dict`` belongs in a checkpoint)."""
        return self._compression

    @property
    def loss_scaler(self) -> LossScaler | None:
        """fp16's loss scale (its ``state_dict`` belongs in a checkpoint); else ``None``."""
        return self._precision.scaler

    @property
    def data_parallel_size(self) -> int:
        """Replicas of each stage (1: a single pipeline)."""
        return 1 if self._replicas is None else self._replicas.size

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """One optimizer per local stage, in stage order."""
        self._require_setup()
        return [self._stages[s].optimizer for s in self.stages]

    @overload
    def train_step(self, batches: Batches, *, return_tensor: Literal[False] = False) -> float: ...
    @overload
    def train_step(self, batches: Batches, *, return_tensor: Literal[True]) -> torch.Tensor: ...

    def train_step(self, batches: Batches, *, return_tensor: bool = False) -> float | torch.Tensor:
        """Train on the next batch of ``batches``; returns its mean loss on every rank: a
        float, or with ``return_tensor`` a float64 tensor ``[1]`` on the device, not read
        on the host (no sync: a trainer reads it when it logs).

        Takes one ``(inputs, targets)`` batch per call (2BW may take the following one
        already and start it); stage 0 uses the inputs, the last stage the targets, but
        every rank checks both, so a bad batch fails on every rank before any work.

        Raises:
            StopIteration: ``batches`` is exhausted (and nothing is in flight).
            ConfigError: a batch cannot be split into ``num_microbatches`` equal parts.
            StageError, CommError: a stage failed; the message names rank, step, action.
        """
        self._check_usable()
        if not hasattr(batches, "__next__"):
            raise ConfigError(
                f"train_step takes an iterator of (inputs, targets), got "
                f"{type(batches).__name__}; wrap it with iter(...)"
            )
        in_flight = self._in_flight is not None
        current = self._in_flight or self._queued or self._take(batches)
        self._queued = None if in_flight else current  # kept if the next batch is bad
        self._setup_on(current)
        nxt = None
        if self._plan.overlapping:
            try:
                nxt = self._take(batches)
            except StopIteration:
                nxt = None
        self._queued = self._in_flight = None
        loss = self._run_call(self._plan.choose(in_flight, nxt is not None), current, nxt)
        self._in_flight = nxt
        return loss if return_tensor else float(loss.item())

    @overload
    def flush(self, *, return_tensor: Literal[False] = False) -> float | None: ...
    @overload
    def flush(self, *, return_tensor: Literal[True]) -> torch.Tensor | None: ...

    def flush(self, *, return_tensor: bool = False) -> float | torch.Tensor | None:
        """Finish all in-flight work (2BW: the batch started early, with its STEP).

        Returns the loss of the batch it finished (a float, or with ``return_tensor`` the
        device tensor, as :meth:`train_step`), or ``None`` if nothing was in flight.
        After a flush the next batch runs on the newest weights, as the first batch did.
        """
        self._check_usable()
        loss = None
        if self._in_flight is not None:
            current, self._in_flight = self._in_flight, None
            loss = self._run_call(self._plan.segments["drain"], current, None)
        self._links.wait_sends(self._call, everything=True)
        for stage in self._stages.values():
            stage.end_run()
        if loss is None or return_tensor:
            return loss
        return float(loss.item())

    def eval_step(self, batches: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """The mean loss of the next batch of ``batches``, forward only, on every rank (with
        replicas: averaged over them): no gradients, no weight versions or optimizer
        touched, so it may come between any two training calls (:mod:`.evaluate`)."""
        batch = take_batch(batches, self._evals, self._m)
        self._check_inputs(batch)
        return float(self._forward_only(lambda run: run.loss(batch.inputs, batch.targets)))

    def predict(self, inputs: Inputs) -> torch.Tensor:
        """The model's outputs for ``inputs`` (cut into at most m micro-batches; a traced
        model: micro-batches of the traced shape), forward only and in ``eval()`` mode, on
        every rank (from the last stage's rank)."""
        first = inputs if isinstance(inputs, torch.Tensor) else next(iter(inputs.values()))
        parts = split_inputs(inputs, -(-len(first) // self._m))
        self._check_inputs(Batch(-1, parts, ()))
        return self._forward_only(lambda run: run.outputs(parts))

    def _forward_only(self, what: Callable[[ForwardOnly], Any]) -> Any:
        self._check_usable()
        self._require_setup()
        self._evals += 1
        run = ForwardOnly(self._links.p2p, self._plan.schedule, self._stages, self._m,
                          self._device, self._evals, self._loss_fn, self._replicas,
                          in_lockstep=self._links.grouped)  # fmt: skip
        try:
            return what(run)
        except CommError as exc:
            self._broken = str(exc)
            raise

    # -- setup -----------------------------------------------------------------------------

    def prepare(self, batch: tuple[Inputs, torch.Tensor]) -> None:
        """Build this rank's stages on ``batch`` (``(inputs, targets)``) without training:
        trace at ``split_points`` (or profile the balance, collectively) on its first
        micro-batch, as the first :meth:`train_step` does by itself; a resumed run calls it
        to load a checkpoint into built stages. Nothing happens once built; a batch that
        does not split into the micro-batches raises ``ConfigError``."""
        self._check_usable()
        if not self._ready:
            self._setup_on(take_batch(iter((batch,)), self._next_batch, self._m))

    def _setup_on(self, current: Batch) -> None:
        """Trace (split points) or profile (no balance) on ``current``'s first micro-batch."""
        if self._split_points is not None and self._traced is None:
            self._setup_traced(to_device(current.inputs[0], self._device))
        if not self._ready:
            sample = current.inputs[0]
            assert isinstance(self._module, nn.Sequential) and isinstance(sample, torch.Tensor)
            self._setup(
                profiled_split(
                    self._module, sample.to(self._device), self._d, rank=self._rank,
                    group=self._group, replicas=self._replicas, timeout_s=self._timeout_s,
                    seed=self._seed, init=cast(LayerInit | None, self._init),
                )
            )  # fmt: skip

    def _require_setup(self) -> None:
        if not self._ready:
            raise ConfigError(
                "balance=None: the split is profiled in the first train_step; call it first, "
                "or pass balance=[...]"
            )

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise StageError(f"rank {self._rank}: pipeline stopped after a failure: {self._broken}")

    def _setup(self, split: list[int]) -> None:
        assert isinstance(self._module, nn.Sequential)
        self._stages = build_stages(
            self._module, split, self.stages, device=self._device, seed=self._seed,
            init=cast(LayerInit | None, self._init), replicas=self._replicas,
            shape=self._shape(), make_stage=self._make_stage,
        )  # fmt: skip
        self._balance = split
        self._boundaries = sequential_boundaries(
            self._module, split, self._device, self._precision.autocast
        )

    def _setup_traced(self, example: Inputs) -> None:
        """Split the model at the split points on ``example`` (one micro-batch) and build
        this rank's stages (every rank traces: stage modules cannot be pickled)."""
        assert self._split_points is not None
        traced, self._stages = build_traced_stages(
            self._module, self._split_points, example, self.stages, device=self._device,
            seed=self._seed, init=cast(ModuleInit | None, self._init),
            replicas=self._replicas, shape=self._shape(), make_stage=self._make_stage,
        )  # fmt: skip
        self._tied = TiedGradients(
            self._links.p2p, traced.tied, self._plan.schedule.rank_of,
            lambda group, batch, stage: tied_tag(self._d, group, batch, stage),
        )  # fmt: skip
        self._traced = traced
        self._boundaries = traced_boundaries(traced, self._precision.precision)

    def _shape(self) -> list[int]:
        """What every replica of this rank's stages must agree on."""
        name = zlib.crc32(self._plan.name.encode())
        return [self._rank, self._plan.num_ranks, self._d, self._m, name, int(self._recompute)]

    def _make_stage(self, s: int, part: nn.Module) -> Stage:
        return Stage(
            s, part, last=s == self._d - 1, loss_fn=self._loss_fn, optimizer=self._optimizer,
            num_microbatches=self._m, versioned=SCHEDULES.get(self._plan.name).versioned,
            track_memory=self._track_memory, precision=self._precision,
        )  # fmt: skip

    def _check_inputs(self, batch: Batch) -> None:
        """A traced model runs only micro-batches of the traced shape (every rank checks)."""
        if self._traced is not None:
            self._traced.check_parts(batch.inputs)

    def _take(self, batches: Iterator[Any]) -> Batch:
        batch = take_batch(batches, self._next_batch, self._m)
        self._check_inputs(batch)
        self._next_batch += 1
        return batch
