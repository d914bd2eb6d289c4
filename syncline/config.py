"""Typed configuration: every knob documented, validated on creation, saved with each run."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from syncline.errors import ConfigError


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
    """

    bucket_cap_mb: float = 25.0
    first_bucket_cap_mb: float | None = None
    broadcast_buffers: bool = True
    find_unused_parameters: bool = False
    rebuild_buckets: bool = True
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        _positive("bucket_cap_mb", self.bucket_cap_mb)
        if self.first_bucket_cap_mb is not None:
            _positive("first_bucket_cap_mb", self.first_bucket_cap_mb)
        _positive("timeout_s", self.timeout_s)

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
        bucket_cap_mb, first_bucket_cap_mb: lazy-allreduce bucket sizes.
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
    bucket_cap_mb: float = 25.0
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
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        for name in ("lr", "bucket_cap_mb", "timeout_s"):
            _positive(name, getattr(self, name))
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
        if self.batch_size % self.world_size:
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
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown config keys {unknown}; valid: {sorted(known)}")
        return cls(**data)
