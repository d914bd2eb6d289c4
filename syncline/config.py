"""Typed configuration: every knob documented, validated on creation, saved with each run."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from syncline.errors import ConfigError
from syncline.partition import check_balance
from syncline.pipeline.plan import SCHEDULES

__all__ = [
    "ALLREDUCE",
    "BACKENDS",
    "CNN_LAYERS",
    "DATASETS",
    "INTERLEAVED_CHUNKS",
    "MODELS",
    "OPTIMIZERS",
    "SCHEDULES",
    "DataParallelConfig",
    "TrainConfig",
]


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{name}={value!r} must be > 0")


@dataclass(frozen=True)
class DataParallelConfig:
    """Settings of :class:`syncline.DataParallel`.

    Attributes:
        bucket_cap_mb: lazy-allreduce threshold: a bucket is launched once its gradients
            (in MiB) are ready. Larger means fewer, larger collectives; smaller, more overlap.
        first_bucket_cap_mb: cap of the first bucket, kept small so that communication
            starts early in backward (DDP's choice, 1 MiB). ``None`` means 1 MiB.
        broadcast_buffers: give every rank rank 0's buffers (e.g. BatchNorm statistics) for
            every training forward, as DDP does; sent asynchronously right after each forward
            so the message overlaps backward instead of delaying the next forward.
        find_unused_parameters: allow parameters that get no gradient in a step; they are
            reduced as zeros, and a parameter unused on every rank keeps ``grad=None``.
        rebuild_buckets: after the first synchronised backward, re-lay the flat buffer in the
            order gradients actually became ready (rank 0's order, broadcast to all).
        timeout_s: how long any wait on other ranks may take before it fails with the rank,
            step and operation in the message.
        autotune_buckets: measure a few bucket plans during the first steps and keep the
            fastest (:mod:`syncline.dp.tuning`); the caps above are then the first
            candidate. ``DataParallel`` turns it on when no cap was given.
        tune_steps_per_trial, tune_rounds: each candidate runs ``tune_steps_per_trial``
            synchronised steps per round, for ``tune_rounds`` rounds (the screening).
        tune_final_rounds, tune_keep_margin: the candidates whose median is within
            ``tune_keep_margin`` (a fraction) of the best then run ``tune_final_rounds``
            more rounds before the choice (successive halving).
        tune_min_bucket_mb: the smallest even cap tried.
    """

    bucket_cap_mb: float = 25.0
    first_bucket_cap_mb: float | None = None
    broadcast_buffers: bool = True
    find_unused_parameters: bool = False
    rebuild_buckets: bool = True
    timeout_s: float = 300.0
    autotune_buckets: bool = False
    tune_steps_per_trial: int = 2
    tune_rounds: int = 2
    tune_final_rounds: int = 4
    tune_keep_margin: float = 0.05
    tune_min_bucket_mb: float = 0.125

    def __post_init__(self) -> None:
        _positive("bucket_cap_mb", self.bucket_cap_mb)
        if self.first_bucket_cap_mb is not None:
            _positive("first_bucket_cap_mb", self.first_bucket_cap_mb)
        _positive("timeout_s", self.timeout_s)
        _positive("tune_min_bucket_mb", self.tune_min_bucket_mb)
        if not self.tune_keep_margin >= 0:
            raise ConfigError(f"tune_keep_margin={self.tune_keep_margin!r} must be >= 0")
        for name in ("tune_steps_per_trial", "tune_rounds", "tune_final_rounds"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r} must be an integer >= 1")

    @property
    def cap_bytes(self) -> int:
        return max(1, int(self.bucket_cap_mb * 2**20))

    @property
    def first_cap_bytes(self) -> int:
        """The first bucket's cap in bytes (see ``first_bucket_cap_mb``)."""
        first = 1.0 if self.first_bucket_cap_mb is None else self.first_bucket_cap_mb
        return max(1, int(min(first, self.bucket_cap_mb) * 2**20))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


MODELS = ("gpt", "cnn")
DATASETS = {"gpt": ("stdlib",), "cnn": ("digits", "synthetic")}
OPTIMIZERS = ("adamw", "sgd")
BACKENDS = ("auto", "gloo", "nccl")
ALLREDUCE = ("flat", "hierarchical")
#: Layers of the CNN as ``syncline train`` builds it: ``build_cnn(CNNConfig())`` has
#: ``depth + 3 == 5`` (stem, one residual block, pool, flatten, linear); kept as a number
#: so this module stays free of torch, checked against the model by a unit test.
CNN_LAYERS = 5
#: Virtual stages per rank of ``schedule="interleaved"`` (Megatron's chunks).
INTERLEAVED_CHUNKS = 2


@dataclass(frozen=True)
class TrainConfig:
    """Everything ``syncline train`` needs; saved as ``config.json`` in each run directory.

    Sizes that must agree across ranks (``batch_size`` against the number of ranks) are
    checked here, before any process starts.

    Attributes:
        model: reference model, ``gpt`` (byte-level transformer) or ``cnn`` (BatchNorm CNN).
        data: data set; ``None`` picks the model's default (gpt: stdlib, cnn: digits).
        nproc_per_node: processes (ranks) per node.
        nnodes, node_rank, rdzv_endpoint: passed to torchrun's elastic launcher.
        batch_size: global batch (samples per optimizer step, over all ranks).
        steps: optimizer steps.
        lr, optimizer, momentum, weight_decay, warmup_steps: the optimisation recipe
            (linear warm-up, then cosine decay to 10 %).
        bucket_cap_mb, first_bucket_cap_mb: lazy-allreduce bucket sizes; both ``None``
            (the default): measured during the first steps (``DataParallel``'s bucket
            autotuning, lossless and fp16/bf16 compression only; otherwise 25 MiB).
        seq_len, n_layer, n_embd, n_head: GPT shape; cnn_width: CNN channels.
        seed: seeds model init and the data order (every rank derives its shard from it).
        threads: ``torch.set_num_threads`` per rank.
        backend: ``auto`` (nccl with GPUs, else gloo), ``gloo`` or ``nccl``.
        log_every: print and record metrics every this many steps.
        timeout_s: limit of any wait on other ranks.
        run_dir: where config, metrics, plot and checkpoint go.
        compression: gradient compressor spec (``none``, ``fp16``, ``bf16``,
            ``csc:DENSITY[:warmup=N][:chunk=C][:momentum=M][:ramp=dense|exp]``, ``topk:RATIO``,
            ``powersgd:RANK[:warmup=N]``); checked against the compressor registry by the CLI.
        allreduce: ``flat`` (one ring over all ranks) or ``hierarchical`` (reduce-scatter in
            each node, allreduce across nodes, allgather in each node).
        ranks_per_node: node size for ``hierarchical``; ``None`` = torchrun's
            LOCAL_WORLD_SIZE. Smaller values emulate several nodes on one machine.
        emulate_network: run every node in its own network namespace on this machine, joined
            by links limited to this rate (tc syntax, e.g. ``100mbit``); needs root and
            iproute2.
        inject_failure: ``"RANK:STEP"`` makes that rank exit at that step (to test that a
            dead rank stops the job with a message naming it).
        pipeline_stages: D, ranks per pipeline; 1 trains with data parallelism only. The
            world is D x replicas (global rank = stage * replicas + replica); this version
            runs one replica (world size == D).
        microbatches: M, micro-batches per batch of a replica; ``None`` resolves to
            ``2 * pipeline_stages`` on creation (small bubble, and valid for every schedule).
        schedule: ``gpipe``, ``1f1b`` (PipeDream-Flush), ``2bw`` (PipeDream-2BW) or
            ``interleaved`` (``INTERLEAVED_CHUNKS`` virtual stages per rank); ``None``
            resolves to ``1f1b`` when pipelined.
        recompute: keep only each stage's inputs and recompute the forward before backward.
        balance: layers per (virtual) stage, summing to the model's layers; ``None``
            profiles the layers on the first micro-batch and balances their times.
    """

    model: str = "gpt"
    data: str | None = None
    nproc_per_node: int = 2
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    batch_size: int = 32
    steps: int = 300
    lr: float = 3e-3
    optimizer: str = "adamw"
    momentum: float = 0.9
    weight_decay: float = 0.0
    warmup_steps: int = 20
    bucket_cap_mb: float | None = None
    first_bucket_cap_mb: float | None = None
    seq_len: int = 64
    n_layer: int = 4
    n_embd: int = 128
    n_head: int = 4
    cnn_width: int = 32
    seed: int = 0
    threads: int = 1
    backend: str = "auto"
    log_every: int = 10
    timeout_s: float = 300.0
    run_dir: str = "runs/latest"
    inject_failure: str | None = None
    compression: str = "none"
    allreduce: str = "flat"
    ranks_per_node: int | None = None
    emulate_network: str | None = None
    pipeline_stages: int = 1
    microbatches: int | None = None
    schedule: str | None = None
    recompute: bool = False
    balance: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ConfigError(f"unknown model {self.model!r}; valid: {', '.join(MODELS)}")
        valid_data = DATASETS[self.model]
        if self.data is not None and self.data not in valid_data:
            raise ConfigError(
                f"data={self.data!r} does not fit model {self.model!r}; valid: "
                f"{', '.join(valid_data)}"
            )
        for name in (
            "nproc_per_node",
            "nnodes",
            "batch_size",
            "steps",
            "seq_len",
            "n_layer",
            "n_embd",
            "n_head",
            "cnn_width",
            "threads",
            "log_every",
            "pipeline_stages",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        for name in ("lr", "timeout_s"):
            _positive(name, getattr(self, name))
        if self.bucket_cap_mb is not None:
            _positive("bucket_cap_mb", self.bucket_cap_mb)
        if self.first_bucket_cap_mb is not None:
            _positive("first_bucket_cap_mb", self.first_bucket_cap_mb)
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"momentum={self.momentum!r} must be in [0, 1)")
        if self.weight_decay < 0 or self.warmup_steps < 0:
            raise ConfigError(
                f"weight_decay={self.weight_decay!r} and warmup_steps={self.warmup_steps!r} "
                "must be >= 0"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"node_rank={self.node_rank} must be in [0, nnodes={self.nnodes})")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ConfigError(f"nnodes={self.nnodes} needs --rdzv-endpoint HOST:PORT")
        if self.pipeline_stages > 1:
            self._check_pipeline()
        elif self.microbatches is not None or self.schedule or self.recompute or self.balance:
            raise ConfigError(
                "microbatches, schedule, recompute and balance need pipeline_stages > 1 "
                f"(got pipeline_stages={self.pipeline_stages}); add --pipeline-stages D"
            )
        elif self.batch_size % self.world_size:
            raise ConfigError(
                f"batch_size={self.batch_size} is not divisible by the number of ranks "
                f"{self.world_size} (nnodes={self.nnodes} x nproc_per_node="
                f"{self.nproc_per_node}); use a multiple of {self.world_size}"
            )
        if self.n_embd % self.n_head:
            raise ConfigError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(
                f"optimizer={self.optimizer!r} is not known; valid: {', '.join(OPTIMIZERS)}"
            )
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend={self.backend!r}; valid: {', '.join(BACKENDS)}")
        if self.inject_failure is not None:
            self.failure_point()
        if self.allreduce not in ALLREDUCE:
            raise ConfigError(f"allreduce={self.allreduce!r}; valid: {', '.join(ALLREDUCE)}")
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
        schedule = self.schedule or "1f1b"
        if schedule not in SCHEDULES:
            raise ConfigError(f"schedule={schedule!r} is unknown; valid: {', '.join(SCHEDULES)}")
        m = 2 * d if self.microbatches is None else self.microbatches
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ConfigError(f"microbatches={m!r} must be a positive integer")
        object.__setattr__(self, "schedule", schedule)
        object.__setattr__(self, "microbatches", m)
        if self.balance is not None:
            object.__setattr__(self, "balance", tuple(self.balance))
        stages, layers = self.virtual_stages, self.model_layers
        if stages > layers:
            raise ConfigError(
                f"pipeline_stages={d} needs {stages} stages but the {self.model} model has "
                f"{layers} layers ({self._layers_text()}); valid: at most {layers} stages"
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
        if schedule == "2bw" and m < d:
            raise ConfigError(f"microbatches={m} must be >= pipeline_stages={d} for 2bw")
        if schedule == "interleaved" and m % d:
            raise ConfigError(
                f"microbatches={m} must be a multiple of pipeline_stages={d} for interleaved"
            )
        if self.balance is not None:
            check_balance(list(self.balance), layers, stages)
        if self.allreduce != "flat":
            raise ConfigError(
                f"allreduce={self.allreduce!r} does not combine with pipeline_stages={d} yet "
                "(each stage's replicas reduce over one flat group); use --allreduce flat"
            )
        if self.compression != "none" and world == d:
            raise ConfigError(
                f"compression={self.compression!r} compresses the gradient allreduce of "
                f"data-parallel replicas, and pipeline_stages={d} on {world} ranks has none; "
                f"use a multiple of {d} ranks (e.g. --nproc-per-node {2 * d}) or --compression none"
            )

    def _layers_text(self) -> str:
        if self.model == "gpt":
            return f"embedding + n_layer={self.n_layer} blocks + head"
        return "stem, residual block, pool, flatten, linear"

    @property
    def pipelined(self) -> bool:
        """Whether the model is split into a pipeline (``pipeline_stages > 1``)."""
        return self.pipeline_stages > 1

    @property
    def model_layers(self) -> int:
        """Length of the model's ``nn.Sequential``: what a pipeline can cut."""
        return self.n_layer + 2 if self.model == "gpt" else CNN_LAYERS

    @property
    def virtual_stages(self) -> int:
        """Stages of the pipeline: ``pipeline_stages``, times the chunks when interleaved."""
        chunks = INTERLEAVED_CHUNKS if self.schedule == "interleaved" else 1
        return self.pipeline_stages * chunks

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
        return self.data or DATASETS[self.model][0]

    def failure_point(self) -> tuple[int, int] | None:
        """``inject_failure`` parsed as (rank, step), or None."""
        if self.inject_failure is None:
            return None
        parts = self.inject_failure.split(":")
        try:
            rank, step = (int(p) for p in parts)
        except ValueError:
            raise ConfigError(
                f"inject_failure={self.inject_failure!r} must look like RANK:STEP, e.g. 1:5"
            ) from None
        if not 0 <= rank < self.world_size or step < 0:
            raise ConfigError(
                f"inject_failure={self.inject_failure!r}: rank must be in [0, {self.world_size})"
                " and step >= 0"
            )
        return rank, step

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON values (``balance`` as a list), as saved in ``config.json``."""
        out = asdict(self)
        if self.balance is not None:
            out["balance"] = list(self.balance)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown config keys {unknown}; valid: {sorted(known)}")
        return cls(**data)
