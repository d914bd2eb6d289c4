"""The pipeline runtime: executes this rank's slice of a generated schedule, action by action.

A ``train_step`` call picks the slice (:mod:`syncline.schedule.plan`) and hands it to the
call loop (:mod:`syncline.pipeline.calls`), which relabels it with the global batch number
and runs each action as ``handler(action, ctx)`` (:mod:`syncline.pipeline.actions`) on this
rank's :class:`~syncline.pipeline.context.PipelineContext`; the order is the generator's,
never re-derived here. Each action is timed for :meth:`Pipeline.trace`. The stages are built
by the first call that needs them, never by the constructor (:mod:`syncline.pipeline.setup`).
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

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, overload

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
from syncline.pipeline import reports
from syncline.pipeline.batches import Batch, Inputs, split_inputs, take_batch
from syncline.pipeline.calls import CallRunner, StageError
from syncline.pipeline.checks import check_args, check_callables, check_device
from syncline.pipeline.config import DEFAULT_SCHEDULE, PipelineConfig
from syncline.pipeline.context import PipelineContext
from syncline.pipeline.evaluate import ForwardOnly
from syncline.pipeline.links import Links, Signature
from syncline.pipeline.memory import StageMemoryStats
from syncline.pipeline.precision import PipelinePrecision
from syncline.pipeline.replicas import StageReplicas, check_compression, check_groups
from syncline.pipeline.setup import StageSetup
from syncline.pipeline.split import full_state
from syncline.pipeline.stage import LossFn, OptimizerFactory, Stage
from syncline.pipeline.timing import ActionClock
from syncline.schedule import SCHEDULES, Action, Plan, Timeline, build_plan
from syncline.schedule.nccl import nccl_plan

Batches = Iterator[tuple[Any, torch.Tensor]]


class Pipeline:
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
            the loss averaged over them. Each stage's weights are broadcast from its first
            replica (a collective over the group, as DDP's construction does) when the
            stages are built: by :meth:`prepare` or the first call that needs them, on every
            rank, never by the constructor; buffers (BatchNorm statistics) are not averaged
            afterwards.
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
        points = None if split_points is None else list(split_points)
        check_args(module, config, points)
        check_callables(loss_fn, optimizer)
        self.config = config
        self._compression = check_compression(compression)
        width = (
            1 if data_parallel_group is None else check_groups(process_group, data_parallel_group)
        )
        size = comm.group_size(process_group)
        self._plan: Plan = build_plan(
            schedule, size, num_stages, num_microbatches, recompute=recompute
        )
        self._loss_fn, self._optimizer = loss_fn, optimizer
        self._track_memory = bool(track_memory)
        rank = comm.group_rank(process_group)
        timeout = float(timeout_s)
        first = next(module.parameters(), None)
        default = first.device if first is not None and not first.is_meta else torch.device("cpu")
        compute = torch.device(device) if device is not None else default
        backend = comm.backend_name(process_group)
        if backend != "gloo":  # the order NCCL cannot deadlock on (syncline.schedule.nccl)
            self._plan = nccl_plan(self._plan)
        wire = comm_device(backend, compute)
        check_device(backend, compute, wire, size)
        dp = [data_parallel_group] if width > 1 else []
        mixed = PipelinePrecision(precision, [process_group, *dp], timeout, compute,
                                  self._compression if dp else None)  # fmt: skip
        unscale = mixed.unscale_bucket if mixed.in_reduce else None
        replicas = (
            StageReplicas(data_parallel_group, self._compression, timeout,
                          num_stages=num_stages, bucket_cap_mb=reduce_bucket_mb,
                          allreduce=replica_allreduce, prepare=unscale, device=compute)
            if width > 1
            else None
        )  # fmt: skip
        self._setup = StageSetup(
            module, config, split_points=points, plan=self._plan, group=process_group,
            timeout_s=timeout, seed=seed, init=init, make_stage=self._make_stage,
        )  # fmt: skip
        links = Links(
            PointToPoint(process_group, timeout_s=timeout, device=wire),
            self._plan.schedule,
            num_microbatches,
            early=backend == "gloo",
            grouped=backend != "gloo",
            signature=self._signature,
            infer=self._setup.infer,
        )
        self._ctx = PipelineContext(
            rank=rank, num_stages=num_stages, last_rank=self._plan.schedule.rank_of(num_stages - 1),
            device=compute, recompute=recompute, links=links, precision=mixed, replicas=replicas,
        )  # fmt: skip
        # NCCL: one collective before the first group of sends and receives
        self._calls = CallRunner(self._ctx, self._plan.num_ranks, ActionClock(compute, rank),
                                 connected=backend == "gloo")  # fmt: skip
        self._next_batch = 0  # global index of the next batch taken from the iterator
        self._evals = 0  # forward-only passes so far (they number their messages)
        self._queued: Batch | None = None  # taken, no work done yet
        self._in_flight: Batch | None = None  # 2BW: taken, first forwards done

    # -- public ------------------------------------------------------------------------------

    @property
    def plan(self) -> Plan:
        """The schedule and the slices each call runs."""
        return self._plan

    @property
    def balance(self) -> list[int]:
        """Layers per stage (after the first ``train_step`` when it was profiled)."""
        if self._setup.balance is None:
            self._setup.build(self._ctx)  # raises unless built (a traced model)
            raise ConfigError("a pipeline split at split_points has no balance")
        return list(self._setup.balance)

    @property
    def stages(self) -> list[int]:
        """The stages this rank runs."""
        return self._plan.stages_of(self._ctx.rank)

    @property
    def stage_module(self) -> nn.Module:
        """This rank's layers with the newest weights (interleaved: an ``nn.ModuleList``)."""
        self._setup.build(self._ctx)
        mods = [self._ctx.stages[s].module for s in self.stages]
        return mods[0] if len(mods) == 1 else nn.ModuleList(mods)

    def local_state_dict(self, *, keep_vars: bool = False) -> dict[str, torch.Tensor]:
        """This rank's layers' newest weights and buffers, named as in the full module.

        The union over all ranks is ``module.state_dict()`` of the trained model (detached
        copies, or with ``keep_vars`` the live tensors; tied weights under each name).
        """
        self._setup.build(self._ctx)
        out = {}
        for s in self.stages:
            out.update(self._full_state(s))
        return out if keep_vars else {k: v.detach().clone() for k, v in out.items()}

    def _full_state(self, s: int) -> dict[str, torch.Tensor]:
        return full_state(self._ctx.stages[s].module, self._setup.first_layer(s))

    def load_local_state_dict(self, state: dict[str, torch.Tensor], next_batch: int) -> None:
        """Resume from a checkpoint: this rank's layers take their weights and buffers from
        ``state`` (named as in the full module, as :meth:`local_state_dict` gives them), and
        the batches taken from now on are numbered from ``next_batch``. Under 2BW the loaded
        weights become the one version held, numbered ``next_batch`` (a checkpoint is taken
        after a flush, when no older version is in use).

        Raises:
            ConfigError: work is in flight, or ``state`` lacks one of this rank's tensors.
        """
        self._setup.build(self._ctx)
        if self._in_flight is not None or self._queued is not None:
            raise ConfigError("load_local_state_dict: a batch is in flight; flush() first")
        self.flush()  # 2BW: drop the older version, so that only the loaded one is held
        missing = sorted(set(self.local_state_dict(keep_vars=True)) - set(state))
        if missing:
            raise ConfigError(f"load_local_state_dict: no value for {missing[:5]}")
        for s in self.stages:
            self._ctx.stages[s].load_state(state, list(self._full_state(s)), next_batch)
        self._next_batch = next_batch

    @property
    def compression(self) -> Compressor:
        """The REDUCE's compressor (its ``state_dict`` belongs in a checkpoint)."""
        return self._compression

    @property
    def loss_scaler(self) -> LossScaler | None:
        """fp16's loss scale (its ``state_dict`` belongs in a checkpoint); else ``None``."""
        return self._ctx.precision.scaler

    @property
    def data_parallel_size(self) -> int:
        """Replicas of each stage (1: a single pipeline)."""
        return 1 if self._ctx.replicas is None else self._ctx.replicas.size

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """One optimizer per local stage, in stage order."""
        self._setup.build(self._ctx)
        return [self._ctx.stages[s].optimizer for s in self.stages]

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
        self._setup.build(self._ctx, current)
        nxt = None
        if self._plan.overlapping:
            try:
                nxt = self._take(batches)
            except StopIteration:
                nxt = None
        self._queued = self._in_flight = None
        loss = self._calls.run(self._plan.choose(in_flight, nxt is not None), current, nxt)
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
            loss = self._calls.run(self._plan.segments["drain"], current, None)
        self._ctx.links.wait_sends(self._ctx.call, everything=True)
        for stage in self._ctx.stages.values():
            stage.end_run()
        if loss is None or return_tensor:
            return loss
        return float(loss.item())

    def eval_step(self, batches: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """The mean loss of the next batch of ``batches``, forward only, on every rank (with
        replicas: averaged over them): no gradients, no weight versions or optimizer
        touched, so it may come between any two training calls (:mod:`.evaluate`)."""
        batch = take_batch(batches, self._evals, self.config.num_microbatches)
        self._setup.check_inputs(batch)
        return float(self._forward_only(lambda run: run.loss(batch.inputs, batch.targets)))

    def predict(self, inputs: Inputs) -> torch.Tensor:
        """The model's outputs for ``inputs`` (cut into at most m micro-batches; a traced
        model: micro-batches of the traced shape), forward only and in ``eval()`` mode, on
        every rank (from the last stage's rank)."""
        first = inputs if isinstance(inputs, torch.Tensor) else next(iter(inputs.values()))
        parts = split_inputs(inputs, -(-len(first) // self.config.num_microbatches))
        self._setup.check_inputs(Batch(-1, parts, ()))
        return self._forward_only(lambda run: run.outputs(parts))

    def _forward_only(self, what: Callable[[ForwardOnly], Any]) -> Any:
        self._check_usable()
        ctx = self._ctx
        self._setup.build(ctx)
        self._evals += 1
        run = ForwardOnly(ctx.links.p2p, self._plan.schedule, ctx.stages,
                          self.config.num_microbatches, ctx.device, self._evals, self._loss_fn,
                          ctx.replicas, in_lockstep=ctx.links.grouped)  # fmt: skip
        try:
            return what(run)
        except CommError as exc:
            ctx.broken = str(exc)
            raise

    # -- reports (read from what the runtime recorded: syncline.pipeline.reports) ----------

    @property
    def wire_bytes(self) -> dict[str, int]:
        """Payload bytes this rank has sent so far: ``activations``, ``gradients`` (to the
        neighbouring stages) and ``reduce`` (to its replicas, as compressed)."""
        return reports.wire_bytes(self._ctx)

    @property
    def early_reduce_buckets(self) -> int:
        """REDUCE buckets started inside a backward, before their REDUCE action (replicas
        only): how much of the replicas' averaging overlapped the last backward."""
        return reports.early_reduce_buckets(self._ctx)

    def memory_stats(self) -> dict[int, StageMemoryStats]:
        """Per local stage: peak stashed activations and weight versions (measured)."""
        self._setup.build(self._ctx)
        return reports.memory_stats(self._ctx, self.stages)

    def reset_memory_stats(self) -> None:
        reports.reset_memory_stats(self._ctx)

    def trace(self, *, origin: float | None = None) -> Timeline:
        """This rank's executed actions as a :class:`~syncline.schedule.Timeline`, in seconds.

        Times are ``time.perf_counter()`` minus ``origin`` (default: this rank's first
        start); on CUDA each action's interval is that of its work on the device, from CUDA
        events placed on the same clock (:mod:`syncline.pipeline.timing`; reading them waits
        for the last ones). On Linux that clock is shared by the processes of a machine, so a
        trainer can gather ``trace(origin=0.0)`` from every rank, subtract the smallest start
        and merge the events; ``to_chrome_trace(timeline, us_per_unit=1e6)`` writes it.
        """
        return reports.timeline(self._calls.clock, self._plan.name, self._ctx.rank, origin)

    # -- setup -----------------------------------------------------------------------------

    def prepare(self, batch: tuple[Inputs, torch.Tensor]) -> None:
        """Build this rank's stages on ``batch`` (``(inputs, targets)``) without training:
        trace at ``split_points`` (or profile the balance, collectively) on its first
        micro-batch, as the first :meth:`train_step` does by itself; with a given
        ``balance``, build them from it (with replicas: a collective). A resumed run calls
        it to load a checkpoint into built stages. Nothing happens once built; a batch that
        does not split into the micro-batches raises ``ConfigError``."""
        self._check_usable()
        if not self._setup.needs_batch:
            self._setup.build(self._ctx)
            return
        m = self.config.num_microbatches
        self._setup.build(self._ctx, take_batch(iter((batch,)), self._next_batch, m))

    def _use_grouped(self, *, ordered: bool = True) -> None:
        """Run the NCCL protocol on any backend (tests on gloo, before the first call): the
        plan in NCCL's order, each run of SEND/RECV as one group, inferred shapes, and with
        ``ordered`` one wire tag, so that gloo pairs messages in issue order as NCCL does."""
        self._plan = nccl_plan(self._plan)
        self._ctx.links.use_grouped(ordered=ordered)

    def _check_usable(self) -> None:
        if self._ctx.broken is not None:
            raise StageError(
                f"rank {self._ctx.rank}: pipeline stopped after a failure: {self._ctx.broken}"
            )

    def _signature(self, a: Action) -> Signature:
        """Shape and dtype of the micro-batch input behind ``a`` (known on every rank)."""
        assert a.batch is not None and a.microbatch is not None
        x = self._ctx.batches[a.batch].inputs[a.microbatch]
        if isinstance(x, torch.Tensor):
            return tuple(x.shape), x.dtype
        first = next(iter(x.values()))  # traced: one shape per input, fixed by the trace
        return tuple(first.shape), first.dtype

    def _make_stage(self, s: int, part: nn.Module) -> Stage:
        return Stage(
            s, part, last=s == self.config.num_stages - 1, loss_fn=self._loss_fn,
            optimizer=self._optimizer, num_microbatches=self.config.num_microbatches,
            versioned=SCHEDULES.get(self._plan.name).versioned,
            track_memory=self._track_memory, precision=self._ctx.precision,
        )  # fmt: skip

    def _take(self, batches: Iterator[Any]) -> Batch:
        batch = take_batch(batches, self._next_batch, self.config.num_microbatches)
        self._setup.check_inputs(batch)
        self._next_batch += 1
        return batch
