"""PURE: ``TrainConfig``, everything ``syncline train`` needs, checked before any process starts.

Each field is documented once, by the docstring under it; the command line is generated from
these fields (:mod:`syncline.cli.options`), so defaults, help and checks cannot drift. Names
of models, data sets, compressors, schedules and allreduce algorithms are checked against
their registries, so a registered plug-in is accepted like a built-in.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass
from typing import Any

from syncline.comm.registry import ALLREDUCE
from syncline.data.registry import check_fits, data_forms
from syncline.dp.config import PRECISIONS
from syncline.dp.registry import COMPRESSORS, compressor_name, forms, parse
from syncline.errors import ConfigError
from syncline.fields import check_positive, check_positive_int, option
from syncline.launch.devices import CPU_NPROC_PER_NODE, refuse_emulated_nccl
from syncline.models.factory import check_split_points, split_names
from syncline.models.registry import ModelSpec, model_forms, model_spec
from syncline.optim.registry import OPTIMIZERS
from syncline.partition import check_balance
from syncline.pipeline.config import DEFAULT_SCHEDULE
from syncline.schedule.registry import SCHEDULES, ScheduleSpec, check_microbatches

__all__ = ["BACKENDS", "FAILURE_PHASES", "LR_SCALINGS", "PRECISIONS", "TrainConfig"]

LR_SCALINGS = ("none", "linear", "sqrt")
#: where ``--inject-failure RANK:STEP:PHASE`` strikes: ``start`` (exit code 17 before the
#: step), or SIGKILL ``forward`` (inside the model's forward), ``allreduce`` (in backward,
#: while the peers wait in the gradient allreduce; a pipeline with replicas: in its stage's
#: backward, while its replicas wait in the REDUCE), ``checkpoint`` (after this rank wrote its
#: part of the step's checkpoint, before it is published)
FAILURE_PHASES = ("start", "forward", "allreduce", "checkpoint")
BACKENDS = ("auto", "gloo", "nccl")

_MODEL, _OPT, _DP = "model and data", "optimisation", "data parallelism"
_PP, _LAUNCH, _OUT = "pipeline parallelism", "launch (passed to torchrun)", "output"
_CKPT = "checkpoints and failures"
_EVAL = "validation"


def _layers_per_stage(text: str) -> tuple[int, ...]:
    """``--balance 2,3`` as ``(2, 3)``; sizes are checked against the model on creation."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(
            f"balance={text!r} is not a comma-separated list of layers per stage, e.g. 2,2"
        ) from None


@dataclass(frozen=True)
class TrainConfig:
    """Everything ``syncline train`` needs; saved as ``config.json`` in each run directory."""

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
    lr: float = option(3e-3, group=_OPT)
    """Peak learning rate at ``base_batch_size`` (linear warm-up, then cosine decay to 10 %);
    ``lr_scaling`` scales it to ``batch_size``."""
    lr_scaling: str = option("none", group=_OPT, choices=lambda: LR_SCALINGS)
    """How the peak learning rate follows the batch: ``none``; ``linear``: lr x batch_size /
    base_batch_size (Goyal et al. 2017, for SGD and LARS, with warm-up); ``sqrt``: lr x
    sqrt(batch_size / base_batch_size) (for Adam and LAMB, You et al. 2019). The resolved
    value is printed at the start and saved in summary.json."""
    base_batch_size: int | None = option(None, group=_OPT, default_text="batch_size")
    """The global batch ``lr`` was tuned for."""
    optimizer: str = option("adamw", group=_OPT, choices=OPTIMIZERS.names)
    """A registered optimizer (:data:`syncline.optim.registry.OPTIMIZERS`): ``adamw``,
    ``sgd``, ``lars`` (SGD with layer-wise trust ratios, You et al. 2017), ``lamb`` (Adam
    with layer-wise trust ratios, You et al. 2019) or a plug-in's."""
    precision: str = option("fp32", group=_OPT, choices=lambda: PRECISIONS)
    """``fp32``; ``bf16`` or ``fp16``: the forward and the loss under autocast, weights,
    gradients and optimizer state in fp32; fp16 scales the loss dynamically, every rank
    agreeing on each overflow (all skip that step; a pipeline's stages and replicas alike),
    the scale checkpointed. An error-feedback compressor (data parallelism or a pipeline's
    REDUCE) gets the gradients unscaled, infs zeroed and flagged for the verdict."""
    momentum: float = option(0.9, group=_OPT)
    """SGD and LARS momentum, in [0, 1); moves into the compressor when it applies momentum
    itself."""
    weight_decay: float = option(0.0, group=_OPT)
    """Decoupled weight decay."""
    warmup_steps: int = option(20, group=_OPT)
    """Linear learning-rate warm-up steps (Goyal et al. 2017), then cosine decay."""
    seed: int = option(0, group=_OPT)
    """Seeds the model's initialisation and the data order (each rank derives its shard)."""
    bucket_cap_mb: float | None = option(None, group=_DP, default_text="measured")
    """Lazy-allreduce threshold in MiB. ``None``: measured: the engine tries a few bucket
    plans during the first ~50 steps and keeps the fastest (stateless compressors only;
    25 with one that keeps per-bucket state)."""
    first_bucket_cap_mb: float | None = option(None, group=_DP, default_text="1, as DDP")
    """First bucket in MiB, small so communication starts early in backward."""
    timeout_s: float = option(300.0, group=_DP, flags=("--timeout",), metavar="SECONDS")
    """Seconds any wait on another rank may take before it fails naming rank, step and
    operation."""
    compression: str = option("none", group=_DP, metavar="SPEC", choices=lambda: forms())
    """Gradient compressor spec from the compressor registry, e.g. ``fp16`` or
    ``csc:0.01:warmup=20``; with pipelines it compresses the replicas' REDUCE."""
    allreduce: str = option("flat", group=_DP, choices=ALLREDUCE.names)
    """A registered allreduce algorithm: ``flat`` (one ring) or ``hierarchical``
    (reduce-scatter in each node, allreduce across nodes, allgather in each node)."""
    ranks_per_node: int | None = option(None, group=_DP, default_text="torchrun's local world")
    """Node size for ``hierarchical``; smaller values emulate several nodes on one machine."""
    pipeline_stages: int = option(1, group=_PP, metavar="D")
    """D, ranks per pipeline; 1 trains with data parallelism only. The world is D x
    replicas (global rank = stage x replicas + replica)."""
    microbatches: int | None = option(None, group=_PP, metavar="M", default_text="2 x D")
    """Micro-batches per batch of a replica; must divide it; the schedule may constrain it."""
    schedule: str | None = option(
        None, group=_PP, metavar="NAME", choices=SCHEDULES.names, default_text=DEFAULT_SCHEDULE
    )
    """A registered pipeline schedule (:data:`syncline.schedule.SCHEDULES`)."""
    recompute: bool = option(False, group=_PP)
    """Keep only stage inputs and recompute each forward before its backward (less
    activation memory, about one more forward of compute)."""
    balance: tuple[int, ...] | None = option(
        None, group=_PP, metavar="N,N,...", parse=_layers_per_stage, default_text="profiled"
    )
    """Layers per (virtual) stage, summing to the model's layers; ``None`` profiles the
    layers on the first micro-batch and balances their times."""
    split_points: tuple[str, ...] | None = option(
        None, group=_PP, metavar="NAME,NAME", parse=split_names, default_text="none"
    )
    """For a factory's model that is no ``nn.Sequential``: the modules (names from
    ``named_modules()``, e.g. ``transformer.h.2``) where stages 2, 3, ... begin; the model
    is traced and cut there (torch's pipeline splitter), called as ``model(**{its forward's
    first argument: inputs})``."""
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
    with). Fires only in the first attempt, so a job restarted by ``max_restarts`` completes."""
    checkpoint_every: int | None = option(None, group=_CKPT, metavar="N", default_text="100")
    """Write a complete sharded checkpoint (every rank its part, in parallel, published
    atomically) under RUN_DIR/checkpoints every N steps and after the last step; 0: only
    the final checkpoint.pt.
    2BW flushes at these steps (the batch after one starts on the newest weights, as the
    first batch does), so the checkpoint holds one weight version and nothing in flight."""
    keep_checkpoints: int = option(2, group=_CKPT, metavar="K")
    """How many of the newest periodic checkpoints to keep."""
    resume: str | None = option(None, group=_CKPT, metavar="RUN_DIR")
    """Continue the run in RUN_DIR from its newest complete checkpoint, with its own
    config.json; only ``steps`` (to extend the run) and launch/output settings may be given
    again. The continuation is bit-identical to an uninterrupted run."""
    max_restarts: int = option(0, group=_CKPT, metavar="K")
    """Let torchrun restart every worker up to K times after a failure; restarted workers
    resume from the newest checkpoint by themselves."""

    def __post_init__(self) -> None:
        spec = self.model_spec
        check_fits(self.data, self.model, spec.datasets, spec.any_data)
        for name in ("nproc_per_node", "nnodes", "batch_size", "steps", "seq_len", "threads"):
            check_positive_int(name, getattr(self, name))
        for name in ("log_every", "pipeline_stages", "keep_checkpoints", "eval_batches"):
            check_positive_int(name, getattr(self, name))
        self._check_validation()
        for name in ("checkpoint_every", "max_restarts"):
            value = getattr(self, name)
            if value is None and name == "checkpoint_every":
                continue  # resolved once the schedule is known
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name}={value!r} must be an integer >= 0")
        object.__setattr__(self, "plugins", tuple(self.plugins))
        object.__setattr__(self, "model_options", spec.coerce_options(self.model_options))
        self.model_config()  # the model's own checks (unknown options, n_embd % n_head, ...)
        for name in ("lr", "timeout_s"):
            check_positive(name, getattr(self, name))
        for name in ("bucket_cap_mb", "first_bucket_cap_mb"):
            if getattr(self, name) is not None:
                check_positive(name, getattr(self, name))
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"momentum={self.momentum!r} must be in [0, 1)")
        if not 0 <= self.weight_decay < math.inf or self.warmup_steps < 0:
            raise ConfigError(
                f"weight_decay={self.weight_decay!r} and warmup_steps={self.warmup_steps!r} "
                "must be >= 0 (and finite)"
            )
        if self.pipeline_stages > 1:
            self._check_pipeline()
        elif self.microbatches is not None or any(
            (self.schedule, self.recompute, self.balance, self.split_points)
        ):
            raise ConfigError(
                "microbatches, schedule, recompute, balance and split_points need "
                "pipeline_stages > 1 "
                f"(got pipeline_stages={self.pipeline_stages}); add --pipeline-stages D"
            )
        elif self.batch_size % self.world_size:
            raise ConfigError(
                f"batch_size={self.batch_size} is not divisible by the number of ranks "
                f"{self.world_size} (nnodes={self.nnodes} x nproc_per_node="
                f"{self.nproc_per_node}); use a multiple of {self.world_size}"
            )
        self._check_checkpoints()
        self._check_launch()
        if self.lr_scaling not in LR_SCALINGS:
            raise ConfigError(
                f"lr_scaling={self.lr_scaling!r} is not known; valid: {', '.join(LR_SCALINGS)}"
            )
        if self.base_batch_size is not None:
            check_positive_int("base_batch_size", self.base_batch_size)
        adaptive = OPTIMIZERS.get(self.optimizer).adaptive
        entry, args = parse(self.compression)  # value ranges are the compressor's to check
        self._check_precision()
        if entry.owns_momentum and args.get("momentum") != 0 and adaptive:
            raise ConfigError(
                f"compression={self.compression!r} applies momentum itself (momentum "
                f"correction) and optimizer={self.optimizer!r} applies its own first moment "
                "on top: momentum twice. Valid: --optimizer sgd or lars (their momentum moves "
                "into the compressor), or add :momentum=0 to the spec (error feedback alone, "
                f"{self.optimizer} keeps its moments)"
            )

    def _check_precision(self) -> None:
        if self.precision not in PRECISIONS:
            raise ConfigError(
                f"precision={self.precision!r} is unknown; valid: {', '.join(PRECISIONS)}"
            )

    def _check_validation(self) -> None:
        f, every = self.val_fraction, self.eval_every
        if isinstance(f, bool) or not isinstance(f, int | float) or not 0 <= f <= 0.5:
            raise ConfigError(f"val_fraction={f!r} is invalid; valid: a number in [0, 0.5]")
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ConfigError(f"eval_every={every!r} is invalid; valid: an integer >= 0")
        tokens = self.sample_tokens
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ConfigError(f"sample_tokens={tokens!r} is invalid; valid: an integer >= 0")
        if not isinstance(self.tensorboard, bool):
            raise ConfigError(f"tensorboard={self.tensorboard!r} is invalid; valid: true or false")
        if every and not f:
            raise ConfigError(
                f"eval_every={every} needs held-out data but val_fraction=0; valid: "
                "val_fraction > 0, or eval_every=0"
            )

    def _check_checkpoints(self) -> None:
        """Resolve ``checkpoint_every`` (None: every 100 steps)."""
        if self.checkpoint_every is None:
            object.__setattr__(self, "checkpoint_every", 100)

    def _check_launch(self) -> None:
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"node_rank={self.node_rank} must be in [0, nnodes={self.nnodes})")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ConfigError(f"nnodes={self.nnodes} needs --rdzv-endpoint HOST:PORT")
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend={self.backend!r}; valid: {', '.join(BACKENDS)}")
        if self.emulate_network is not None and self.backend == "nccl":
            refuse_emulated_nccl(self.emulate_network, "given")
        if self.inject_failure is not None:
            self.failure_point()
        ALLREDUCE.get(self.allreduce)
        if self.ranks_per_node is not None and (
            self.ranks_per_node <= 0 or self.world_size % self.ranks_per_node
        ):
            raise ConfigError(
                f"ranks_per_node={self.ranks_per_node} must be positive and divide the "
                f"{self.world_size} ranks"
            )

    def _check_pipeline(self) -> None:
        """Resolve the pipeline defaults and check them against the model and the ranks."""
        d, world = self.pipeline_stages, self.world_size
        schedule = self.schedule or DEFAULT_SCHEDULE
        SCHEDULES.get(schedule)
        m = 2 * d if self.microbatches is None else self.microbatches
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ConfigError(f"microbatches={m!r} must be a positive integer")
        object.__setattr__(self, "schedule", schedule)
        object.__setattr__(self, "microbatches", m)
        if self.balance is not None:
            object.__setattr__(self, "balance", tuple(self.balance))
        stages = self.virtual_stages
        if self.split_points is not None:
            object.__setattr__(self, "split_points", tuple(self.split_points))
            check_split_points(self.split_points, self.model, stages, self.balance)
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
        check_microbatches(schedule, d, m, m_name="microbatches", d_name="pipeline_stages")
        if self.balance is not None:
            check_balance(list(self.balance), layers, stages)
        if not ALLREDUCE.get(self.allreduce).with_pipelines:
            raise ConfigError(
                f"allreduce={self.allreduce!r} does not combine with pipeline_stages={d} yet "
                "(each stage's replicas reduce over one flat group); use --allreduce flat"
            )
        if compressor_name(self.compression) != "none" and world == d:
            raise ConfigError(
                f"compression={self.compression!r} compresses the gradient allreduce of "
                f"data-parallel replicas, and pipeline_stages={d} on {world} ranks has none; "
                f"use a multiple of {d} ranks (e.g. --nproc-per-node {2 * d}) or --compression none"
            )

    @property
    def peak_lr(self) -> float:
        """The peak learning rate ``lr`` scaled from ``base_batch_size`` to ``batch_size``."""
        ratio = self.batch_size / (self.base_batch_size or self.batch_size)
        factor: float = {"none": 1.0, "linear": ratio, "sqrt": ratio**0.5}[self.lr_scaling]
        return float(self.lr * factor)

    @property
    def model_spec(self) -> ModelSpec:
        """The model's registry entry."""
        return model_spec(self.model)

    @property
    def schedule_spec(self) -> ScheduleSpec | None:
        """The pipeline schedule's registry entry, or ``None`` without a pipeline."""
        return SCHEDULES.get(self.schedule) if self.schedule else None

    def model_config(self) -> Any:
        """The model's shape config: its defaults, ``seq_len`` and ``model_options``."""
        return self.model_spec.make_config(self.model_options, self.seq_len)

    @property
    def owns_momentum(self) -> bool:
        """Whether the compressor applies momentum itself (so SGD must not)."""
        return COMPRESSORS.get(compressor_name(self.compression)).owns_momentum

    @property
    def pipelined(self) -> bool:
        """Whether the model is split into a pipeline (``pipeline_stages > 1``)."""
        return self.pipeline_stages > 1

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
    def virtual_stages(self) -> int:
        """Stages of the pipeline: ``pipeline_stages`` times the schedule's stages per rank."""
        spec = self.schedule_spec
        return self.pipeline_stages * (spec.stages_per_rank if spec else 1)

    @property
    def pipeline_replicas(self) -> int:
        """Data-parallel replicas of each pipeline stage (1 without a pipeline: all ranks
        are replicas of one another then, see ``world_size``)."""
        return self.world_size // self.pipeline_stages

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
        if phase == "allreduce" and self.pipeline_stages > 1 and self.pipeline_replicas == 1:
            raise ConfigError(
                f"inject_failure={self.inject_failure!r}: a pipeline without replicas has no "
                "allreduce; valid phases: start, forward, checkpoint (allreduce: with replicas)"
            )
        if phase == "checkpoint" and not self.checkpoint_due(step + 1):
            raise ConfigError(
                f"inject_failure={self.inject_failure!r}: no checkpoint is written at step "
                f"{step} (checkpoint_every={self.checkpoint_every or 0}, steps={self.steps}); "
                "valid: a STEP with STEP+1 a multiple of checkpoint_every, or the last step"
            )
        return rank, step, phase

    def checkpoint_due(self, done: int) -> bool:
        """Whether a checkpoint is written once ``done`` steps are done: every
        ``checkpoint_every`` steps and after the last one, so that ``--resume RUN_DIR --steps
        N`` extends a finished run from its end instead of replaying its last steps."""
        every = self.checkpoint_every or 0
        return every > 0 and (done % every == 0 or done == self.steps)

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON values (tuples as lists), as saved in ``config.json``."""
        out = asdict(self)
        for name in ("balance", "plugins", "split_points"):
            if out[name] is not None:
                out[name] = list(out[name])
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown config keys {unknown}; valid: {sorted(known)}")
        return cls(**data)
