"""PURE: ``TrainConfig``, everything ``syncline train`` needs, checked before any process starts.

The config is composed, not copied: each layer's settings are a part owned and documented by
that layer (``cfg.optim``: :class:`~syncline.optim.config.OptimConfig`; ``cfg.dp``:
:class:`~syncline.dp.config.DataParallelSettings`; ``cfg.pipeline``:
:class:`~syncline.pipeline.config.PipelineSettings`; ``cfg.checkpoint``:
:class:`~syncline.train.checkpoint_config.CheckpointConfig`), and this class holds only what
is the run's own: the model and data, the batch, steps and seed, the waits' timeout and the
precision (both parallelisms use them), launch, output and validation. Each part checks its
own values on creation; what spans parts (the batch against the ranks, the stages against
the model's layers, a compressor's momentum against the optimizer's) is checked here.

Each field is documented once, by the docstring under it; the command line is generated from
these fields and the parts' (:mod:`syncline.cli.options`), under the same flat names
(``--lr``, not ``--optim-lr``), so defaults, help and checks cannot drift. Names of models,
data sets, compressors, schedules and allreduce algorithms are checked against their
registries, so a registered plug-in is accepted like a built-in.

``config.json`` holds the parts as nested objects (:meth:`TrainConfig.to_dict`);
:meth:`TrainConfig.from_dict` also reads the flat form earlier versions wrote, so their run
directories resume.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from syncline.comm.registry import ALLREDUCE
from syncline.data.registry import check_fits, data_forms
from syncline.dp.config import GROUP as _DP
from syncline.dp.config import PRECISIONS, DataParallelSettings
from syncline.dp.guard_config import GuardConfig
from syncline.dp.registry import compressor_name, parse
from syncline.errors import ConfigError
from syncline.fields import (
    check_float,
    check_int,
    flatten,
    from_flat,
    leaves,
    option,
    part,
    part_type,
)
from syncline.launch.devices import CPU_NPROC_PER_NODE, refuse_emulated_nccl
from syncline.models.factory import check_split_points
from syncline.models.registry import ModelSpec, model_forms, model_spec
from syncline.optim.config import GROUP as _OPT
from syncline.optim.config import LR_SCALINGS, OptimConfig
from syncline.partition import check_balance
from syncline.pipeline.config import PipelineSettings
from syncline.train.checkpoint_config import CheckpointConfig

__all__ = ["BACKENDS", "FAILURE_PHASES", "LR_SCALINGS", "PRECISIONS", "TrainConfig"]

#: where ``--inject-failure RANK:STEP:PHASE`` strikes: ``start`` (exit code 17 before the
#: step), or SIGKILL ``forward`` (inside the model's forward), ``allreduce`` (in backward,
#: while the peers wait in the gradient allreduce; a pipeline with replicas: in its stage's
#: backward, while its replicas wait in the REDUCE), ``checkpoint`` (after this rank wrote its
#: part of the step's checkpoint, before it is published), ``nospace`` (this rank's
#: checkpoint write fails with ENOSPC, as on a full disk; the rank lives on)
FAILURE_PHASES = ("start", "forward", "allreduce", "checkpoint", "nospace")
BACKENDS = ("auto", "gloo", "nccl")

_MODEL, _LAUNCH, _OUT = "model and data", "launch (passed to torchrun)", "output"
_EVAL = "validation"


@dataclass(frozen=True)
class TrainConfig:
    """Everything ``syncline train`` needs; saved as ``config.json`` in each run directory.

    Build it from parts (``TrainConfig(optim=OptimConfig(lr=0.01))``) or from flat names
    (``TrainConfig.from_flat(lr=0.01)``, as the command line does).
    """

    model: str = option("gpt", group=_MODEL, metavar="NAME", choices=model_forms)
    """A registered model (:data:`syncline.models.MODELS`): ``gpt`` (byte-level
    transformer), ``cnn`` (BatchNorm CNN) or a plug-in's; or your own as
    ``package.module:factory``, a function or class returning an ``nn.Module`` or a pair
    ``(module, loss)``, called with the ``model_options`` (and ``seq_len`` if it takes it)."""
    data: str | None = option(
        None, group=_MODEL, metavar="SPEC", choices=data_forms, default_text="the model's first"
    )
    """A data set the model trains on: a registered one (gpt: stdlib, text:PATH; cnn:
    digits, synthetic, images:PATH), ``text:PATH`` (a text file or folder, as bytes),
    ``images:PATH`` (class sub-folders of images), or ``package.module:factory`` returning a
    map-style data set of (input, target); ``None`` picks the model's first."""
    model_options: dict[str, Any] = option(
        default_factory=dict,
        group=_MODEL,
        flags=("--model-option",),
        metavar="KEY=VALUE",
        default_text="none",
    )
    """Fields of the model's config (e.g. ``GPTConfig``'s ``n_layer``), overriding its
    defaults; repeat the flag for several. The built-in models also have their own flags."""
    seq_len: int = option(64, group=_MODEL)
    """Tokens per sample of a sequence model (the GPT's context, in bytes)."""
    batch_size: int = option(32, group=_OPT)
    """Global batch: samples per optimizer step over all ranks; must divide evenly."""
    steps: int = option(300, group=_OPT)
    """Optimizer steps."""
    optim: OptimConfig = part(OptimConfig)
    """The optimizer and its learning-rate schedule."""
    seed: int = option(0, group=_OPT)
    """Seeds the model's initialisation and the data order (each rank derives its shard)."""
    dp: DataParallelSettings = part(DataParallelSettings)
    """Data parallelism: bucket caps, compressor, allreduce algorithm (a pipeline's replicas
    use the compressor and the algorithm too)."""
    timeout_s: float = option(
        300.0,
        group=_DP,
        flags=("--timeout",),
        metavar="SECONDS",
        listed_after="first_bucket_cap_mb",
    )
    """Seconds any wait on another rank may take before it fails naming rank, step and
    operation."""
    precision: str = option(
        "fp32", group=_OPT, choices=lambda: PRECISIONS, listed_after="optimizer"
    )
    """``fp32``; ``bf16`` or ``fp16``: the forward and the loss under autocast, weights,
    gradients and optimizer state in fp32; fp16 scales the loss dynamically, every rank
    agreeing on each overflow (all skip that step; a pipeline's stages and replicas alike),
    the scale checkpointed. An error-feedback compressor (data parallelism or a pipeline's
    REDUCE) gets the gradients unscaled, infs zeroed and flagged for the verdict."""
    pipeline: PipelineSettings = part(PipelineSettings)
    """Pipeline parallelism: stages, micro-batches, schedule, recompute, balance."""
    nproc_per_node: int = option(
        CPU_NPROC_PER_NODE,
        group=_LAUNCH,
        flags=("--nproc-per-node", "--nproc"),
        default_text=f"one per visible GPU under nccl, else {CPU_NPROC_PER_NODE}",
    )
    """Processes (ranks) on this node, each on its own device: ``cuda:(LOCAL_RANK % visible
    GPUs)`` under NCCL, the CPU under gloo."""
    nnodes: int = option(1, group=_LAUNCH)
    """Number of nodes."""
    node_rank: int = option(0, group=_LAUNCH)
    """This node's rank, 0..nnodes-1."""
    rdzv_endpoint: str | None = option(None, group=_LAUNCH, metavar="HOST:PORT")
    """Node 0's address for the rendezvous (needed when ``nnodes > 1``)."""
    backend: str = option("auto", group=_LAUNCH, choices=lambda: BACKENDS)
    """``auto`` (nccl with GPUs, else gloo), ``gloo`` or ``nccl``."""
    threads: int = option(1, group=_LAUNCH)
    """``torch.set_num_threads`` per rank."""
    emulate_network: str | None = option(None, group=_LAUNCH, metavar="RATE")
    """Run each node in its own Linux network namespace on this machine, joined by
    tc-tbf-limited links of RATE (e.g. ``100mbit``); without ``nnodes`` every rank is its
    own node. Needs root and iproute2; everything it creates is removed afterwards. CPU
    ranks over gloo only (NCCL would bypass the emulated links)."""
    plugins: tuple[str, ...] = option(
        (), group=_LAUNCH, flags=("--plugin",), metavar="MODULE", default_text="none"
    )
    """Modules imported in every process before anything else, whose ``register`` calls add
    models, data sets, compressors, schedules or allreduce algorithms; repeatable. Found on
    PYTHONPATH or in the current directory."""
    run_dir: str = option("runs/latest", group=_OUT, default_text="runs/<time>-<model>")
    """Where config, metrics, plot and checkpoint go."""
    log_every: int = option(10, group=_OUT)
    """Print and record metrics every this many steps."""
    tensorboard: bool = option(False, group=_OUT)
    """Also write the recorded scalars (losses, learning rate, samples/s, bytes on the wire,
    exposed communication, a pipeline's bubble fraction) to RUN_DIR/tensorboard for
    TensorBoard (rank 0; metrics.jsonl stays the source of truth)."""
    val_fraction: float = option(0.05, group=_EVAL, metavar="F")
    """Share of the data set held out for validation and never trained on (the end of a
    text's token stream; the last samples of other data sets), in [0, 0.5]; 0 trains on
    everything and needs ``eval_every`` 0."""
    eval_every: int = option(100, group=_EVAL, metavar="N")
    """Compute the validation loss (and a language model's perplexity) at step 0, every N
    steps and at the last step, on every rank's shard of the held-out data, averaged; 0:
    never. Recorded in metrics.jsonl, drawn on loss.png, the best in summary.json."""
    eval_batches: int = option(4, group=_EVAL, metavar="K")
    """Global batches of ``batch_size`` held-out samples per validation: the same K batches
    every time, so the curve shows the model and not the sample."""
    sample_tokens: int = option(200, group=_EVAL, metavar="N")
    """A language model generates N tokens after a held-out prompt at the end (seeded
    sampling from the trained model), printed and saved as sample.txt and in summary.json;
    0: none. Other models ignore it."""
    inject_failure: str | None = option(None, group=_OUT, metavar="RANK:STEP")
    """Testing aid: make RANK fail at STEP, to see the job stop cleanly and name it: exit
    before the step, or with ``:PHASE`` die by SIGKILL inside it (``forward``,
    ``allreduce``, ``checkpoint``: after writing its part of the checkpoint the step ends
    with), or ``nospace``: its write of that checkpoint fails as on a full disk (ENOSPC).
    Fires only in the first attempt, so a job restarted by ``max_restarts`` completes."""
    checkpoint: CheckpointConfig = part(CheckpointConfig)
    """Periodic checkpoints, resuming, restarts after a failure."""
    guard: GuardConfig = part(GuardConfig)
    """The guard against NaN/Inf and loss spikes, and what an event does."""

    def __post_init__(self) -> None:
        self._check_parts()
        spec = self.model_spec
        check_fits(self.data, self.model, spec.datasets, spec.any_data)
        for name in ("nproc_per_node", "nnodes", "batch_size", "steps", "seq_len", "threads"):
            check_int(name, getattr(self, name))
        for name in ("log_every", "eval_batches"):
            check_int(name, getattr(self, name))
        self._check_validation()
        object.__setattr__(self, "plugins", tuple(self.plugins))
        object.__setattr__(self, "model_options", spec.coerce_options(self.model_options))
        self.model_config()  # the model's own checks (unknown options, n_embd % n_head, ...)
        check_float("timeout_s", self.timeout_s, above=0)
        if self.pipeline.pipelined:
            self._check_pipeline()
        elif self.batch_size % self.world_size:
            raise ConfigError(
                f"batch_size={self.batch_size} is not divisible by the number of ranks "
                f"{self.world_size} (nnodes={self.nnodes} x nproc_per_node="
                f"{self.nproc_per_node}); use a multiple of {self.world_size}"
            )
        self._check_launch()
        self._check_guard()
        if self.precision not in PRECISIONS:
            raise ConfigError(
                f"precision={self.precision!r} is unknown; valid: {', '.join(PRECISIONS)}"
            )
        entry, args = parse(self.dp.compression)  # value ranges are the compressor's to check
        if entry.owns_momentum and args.get("momentum") != 0 and self.optim.adaptive:
            optimizer = self.optim.optimizer
            raise ConfigError(
                f"compression={self.dp.compression!r} applies momentum itself (momentum "
                f"correction) and optimizer={optimizer!r} applies its own first moment "
                "on top: momentum twice. Valid: --optimizer sgd or lars (their momentum moves "
                "into the compressor), or add :momentum=0 to the spec (error feedback alone, "
                f"{optimizer} keeps its moments)"
            )

    def _check_parts(self) -> None:
        """Each part is its own config class (a dict would skip its checks)."""
        for f in dataclasses.fields(self):
            value, kind = getattr(self, f.name), part_type(f)
            if kind is not None and not isinstance(value, kind):
                raise ConfigError(
                    f"{f.name}={value!r} is invalid; valid: an instance of {kind.__name__} (or "
                    "TrainConfig.from_flat / from_dict, which build the parts)"
                )

    def _check_validation(self) -> None:
        check_float("val_fraction", self.val_fraction, at_least=0, at_most=0.5)
        check_int("eval_every", self.eval_every, low=0)
        check_int("sample_tokens", self.sample_tokens, low=0)
        if not isinstance(self.tensorboard, bool):
            raise ConfigError(f"tensorboard={self.tensorboard!r} is invalid; valid: true or false")
        if self.eval_every and not self.val_fraction:
            raise ConfigError(
                f"eval_every={self.eval_every} needs held-out data but val_fraction=0; valid: "
                "val_fraction > 0, or eval_every=0"
            )

    def _check_launch(self) -> None:
        check_int("node_rank", self.node_rank, low=0, high=self.nnodes - 1)
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ConfigError(f"nnodes={self.nnodes} needs --rdzv-endpoint HOST:PORT")
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend={self.backend!r}; valid: {', '.join(BACKENDS)}")
        if self.emulate_network is not None and self.backend == "nccl":
            refuse_emulated_nccl(self.emulate_network, "given")
        if self.inject_failure is not None:
            self.failure_point()
        per_node = self.dp.ranks_per_node
        if per_node is not None and self.world_size % per_node:
            raise ConfigError(
                f"ranks_per_node={per_node} must be positive and divide the {self.world_size} ranks"
            )

    def _check_guard(self) -> None:
        """What the non-finite guard runs with (:mod:`syncline.dp.guard` says why)."""
        g = self.guard
        if not g.on:
            return
        what = f"on_nonfinite={g.on_nonfinite!r}"
        if self.pipeline.pipelined:
            raise ConfigError(
                f"{what} is not supported with pipeline_stages={self.pipeline.pipeline_stages} "
                "yet; valid: pipeline_stages=1 (data parallelism), or on_nonfinite=off"
            )
        if compressor_name(self.dp.compression) not in ("none", "fp16", "bf16"):
            raise ConfigError(
                f"{what} with compression={self.dp.compression!r} is not supported: the "
                "guard's verdict rides the gradient allreduce, which this compressor "
                "sparsifies or factorises; valid: compression none, fp16 or bf16"
            )
        if self.dp.sync != "every-step":
            raise ConfigError(
                f"{what} with sync={self.dp.sync!r} is not supported: the guard's verdict "
                "rides each step's gradient allreduce, which a periodic sync skips; valid: "
                "sync every-step"
            )
        if self.precision == "fp16":
            raise ConfigError(
                f"{what} with precision=fp16 is not supported: the loss scaler already "
                "skips steps whose scaled gradient overflows; valid: precision fp32 or bf16"
            )
        if self.optim.optimizer == "lamb":
            raise ConfigError(
                f"{what} with optimizer='lamb' is not supported: LAMB keeps its step as a "
                "Python int, which a step skipped on the device cannot restore; valid: "
                "adamw, sgd or lars"
            )
        injected = g.injection()
        if injected is not None and not (
            injected[0] < self.world_size and injected[1] < self.steps
        ):
            raise ConfigError(
                f"inject_nonfinite={g.inject_nonfinite!r}: rank must be in [0, "
                f"{self.world_size}) and step in [0, steps={self.steps})"
            )

    def _check_pipeline(self) -> None:
        """Check the pipeline against the model, the ranks and the other parts."""
        p, world = self.pipeline, self.world_size
        d, m, stages = p.pipeline_stages, p.microbatches, p.virtual_stages
        assert m is not None  # resolved by the part
        if p.split_points is not None:
            check_split_points(p.split_points, self.model, stages, p.balance)
        elif stages > (layers := self.model_layers):
            raise ConfigError(
                f"pipeline_stages={d} needs {stages} stages but the {self.model} model has "
                f"{layers} layers ({self.model_spec.describe_layers(self.model_config())}); "
                f"valid: at most {layers} stages"
            )
        if world % d:
            raise ConfigError(
                f"pipeline_stages={d} does not divide the {world} ranks (nnodes={self.nnodes} "
                f"x nproc_per_node={self.nproc_per_node}); use a world size that D divides"
            )
        replicas = world // d
        if self.batch_size % replicas or (self.batch_size // replicas) % m:
            raise ConfigError(
                f"batch_size={self.batch_size} over {replicas} replica(s) does not split into "
                f"microbatches={m} equal micro-batches; use a multiple of {replicas * m}"
            )
        if p.balance is not None:
            check_balance(list(p.balance), layers, stages)
        if not ALLREDUCE.get(self.dp.allreduce).with_pipelines:
            raise ConfigError(
                f"allreduce={self.dp.allreduce!r} does not combine with pipeline_stages={d} "
                "yet (each stage's replicas reduce over one flat group); use --allreduce flat"
            )
        if self.dp.periodic_sync:
            raise ConfigError(
                f"sync={self.dp.sync!r} synchronises data-parallel replicas less often; "
                f"pipeline_stages={d} runs pipelines (their replicas reduce every batch); "
                "valid: --sync every-step with pipelines, or pipeline_stages=1"
            )
        if compressor_name(self.dp.compression) != "none" and world == d:
            raise ConfigError(
                f"compression={self.dp.compression!r} compresses the gradient allreduce of "
                f"data-parallel replicas, and pipeline_stages={d} on {world} ranks has none; "
                f"use a multiple of {d} ranks (e.g. --nproc-per-node {2 * d}) or --compression none"
            )

    @property
    def peak_lr(self) -> float:
        """The peak learning rate ``optim.lr`` scaled from ``optim.base_batch_size`` to
        ``batch_size`` (:meth:`OptimConfig.peak_lr`)."""
        return self.optim.peak_lr(self.batch_size)

    @property
    def model_spec(self) -> ModelSpec:
        """The model's registry entry."""
        return model_spec(self.model)

    def model_config(self) -> Any:
        """The model's shape config: its defaults, ``seq_len`` and ``model_options``."""
        return self.model_spec.make_config(self.model_options, self.seq_len)

    @property
    def model_layers(self) -> int:
        """Layers of the model's ``nn.Sequential``: what a pipeline can cut.

        Raises:
            ConfigError: the model cannot be cut into a pipeline.
        """
        layers = self.model_spec.num_layers(self.model_config())
        if layers is None:
            raise ConfigError(
                f"model {self.model!r} cannot be cut into a pipeline (its spec gives no "
                "num_layers); valid: pipeline_stages=1"
            )
        return layers

    @property
    def pipeline_replicas(self) -> int:
        """Data-parallel replicas of each pipeline stage (1 without a pipeline: all ranks
        are replicas of one another then, see ``world_size``)."""
        return self.world_size // self.pipeline.pipeline_stages

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def dataset(self) -> str:
        """The data set trained on: ``data``, or the model's default."""
        return self.data or self.model_spec.datasets[0]

    def failure_point(self) -> tuple[int, int, str] | None:
        """``inject_failure`` parsed as (rank, step, phase), or None."""
        if self.inject_failure is None:
            return None
        parts = self.inject_failure.split(":")
        try:
            if len(parts) not in (2, 3):
                raise ValueError
            rank, step = int(parts[0]), int(parts[1])
        except ValueError:
            raise ConfigError(
                f"inject_failure={self.inject_failure!r} must look like RANK:STEP[:PHASE], "
                f"e.g. 1:5 or 1:5:allreduce"
            ) from None
        phase = parts[2] if len(parts) == 3 else "start"
        if phase not in FAILURE_PHASES:
            raise ConfigError(
                f"inject_failure={self.inject_failure!r}: phase {phase!r} is unknown; valid: "
                f"{', '.join(FAILURE_PHASES)}"
            )
        if not 0 <= rank < self.world_size or not 0 <= step < self.steps:
            raise ConfigError(
                f"inject_failure={self.inject_failure!r}: rank must be in [0, {self.world_size})"
                f" and step in [0, steps={self.steps})"
            )
        if phase == "allreduce" and self.pipeline.pipelined and self.pipeline_replicas == 1:
            raise ConfigError(
                f"inject_failure={self.inject_failure!r}: a pipeline without replicas has no "
                "allreduce; valid phases: start, forward, checkpoint (allreduce: with replicas)"
            )
        if phase in ("checkpoint", "nospace") and not self.checkpoint_due(step + 1):
            every = self.checkpoint.checkpoint_every or 0
            raise ConfigError(
                f"inject_failure={self.inject_failure!r}: no checkpoint is written at step "
                f"{step} (checkpoint_every={every}, steps={self.steps}); "
                "valid: a STEP with STEP+1 a multiple of checkpoint_every, or the last step"
            )
        return rank, step, phase

    def checkpoint_due(self, done: int) -> bool:
        """Whether a checkpoint is written once ``done`` steps are done
        (:meth:`CheckpointConfig.due` over this run's ``steps``)."""
        return self.checkpoint.due(done, self.steps)

    def to_dict(self) -> dict[str, Any]:
        """The config as JSON values, as saved in ``config.json``: each part an object under
        its name (``{"optim": {"lr": ...}, ...}``), tuples as lists."""
        out = asdict(self)
        for leaf in leaves(type(self)):
            holder = out
            for key in leaf.path[:-1]:
                holder = holder[key]
            if isinstance(holder[leaf.name], tuple):
                holder[leaf.name] = list(holder[leaf.name])
        return out

    def to_flat_dict(self) -> dict[str, Any]:
        """:meth:`to_dict` with every setting at the top, by its flat name (``lr``)."""
        return flatten(type(self), self.to_dict())

    @classmethod
    def from_flat(cls, **values: Any) -> TrainConfig:
        """A config from settings by flat name (``lr=0.01, pipeline_stages=2``), each given
        to the part that owns it; the others keep their defaults.

        Raises:
            ConfigError: a name that is no setting (naming the valid ones), or a bad value.

        Example:
            >>> TrainConfig.from_flat(lr=0.01, pipeline_stages=2).pipeline.microbatches
            4
        """
        return from_flat(cls, values)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainConfig:
        """A config as :meth:`to_dict` wrote it, or in the flat form of earlier versions
        (every setting at the top), which run directories written then still hold.

        Raises:
            ConfigError: an unknown key (naming the valid ones), or a bad value.
        """
        return cls.from_flat(**flatten(cls, data))
