"""PURE: enumerate the configurations of a model on N ranks, predict each, rank them.

The space is PipeDream-2BW's planner's (section 4: every depth ``d`` and width ``w`` with
``d * w = N``, every micro-batch size, recomputation on and off) widened by what syncline
adds: every schedule, and for the data-parallel part each compressor and allreduce
algorithm. What does not fit in memory is kept but ranked after everything that fits, so a
user sees why a configuration was dropped.

Ranking: predicted step time, with two rules a user would apply by hand. A lossy compressor
(everything but ``none``, ``fp16`` and ``bf16``) or a periodic sync (local SGD, DiLoCo)
changes what is optimised, so it ranks
above an exact configuration only when it is predicted at least ``LOSSY_MARGIN`` faster;
and times within ``SearchSpace.tie`` of each other are a tie, broken by less memory. The
tie is the measurement error of the costs (``TIE``, 0.5 %, for profiled costs, whose layer
times are medians of a few noisy runs); costs computed from a shape and a datasheet carry
no measurement noise, so a search over them may set ``tie=0``: throughput alone decides.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from syncline.dp.registry import COMPRESSORS, compressor_name
from syncline.dp.syncs import DEFAULT_SYNC, parse_sync
from syncline.errors import ConfigError
from syncline.fields import check_float, check_int
from syncline.optim.registry import OPTIMIZERS
from syncline.planner.costs import ModelCosts
from syncline.planner.hardware import Cluster
from syncline.planner.predict import Configuration, Prediction, predict
from syncline.schedule import SCHEDULES
from syncline.schedule.registry import check_microbatches

__all__ = ["SearchSpace", "candidates", "default_compressions", "search"]


def default_compressions() -> tuple[str, ...]:
    """A spec of every registered compressor the planner can price (a traffic model in its
    registry entry): its ``example``, or its name; a plug-in's is searched like a built-in."""
    return tuple(c.example or c.name for c in COMPRESSORS if c.traffic is not None)


EXACT_COMPRESSIONS = ("none", "fp16", "bf16")
LOSSY_MARGIN = 0.05
TIE = 0.005


@dataclass(frozen=True)
class SearchSpace:
    """What the search may choose from."""

    ranks: int
    batch_size: int
    compressions: tuple[str, ...] = field(default_factory=default_compressions)
    """Compressors for data parallelism (and pipelines with replicas)."""
    schedules: tuple[str, ...] = ("gpipe", "1f1b", "2bw", "interleaved")
    max_microbatches: int | None = 64
    """The most micro-batches per batch searched (``None``: every divisor of the batch);
    each one's schedule is simulated, so a cap keeps a large batch's search short."""
    tie: float = TIE
    """Relative step-time difference within which two fitting configurations tie and the
    one with less memory wins: the measurement error of the costs."""
    pipelines: bool = True
    data_parallel: bool = True
    optimizer: str = "adamw"
    bucket_cap_mb: float = 25.0
    syncs: tuple[str, ...] = (DEFAULT_SYNC,)
    """How often data-parallel replicas synchronise (``syncline.dp.syncs``); a periodic one
    is searched uncompressed (after its start no gradient is sent)."""

    def __post_init__(self) -> None:
        for name in ("ranks", "batch_size"):
            check_int(name, getattr(self, name))
        for spec in self.syncs:
            parse_sync(spec)
        if self.max_microbatches is not None:
            check_int("max_microbatches", self.max_microbatches)
        check_float("tie", self.tie, at_least=0, below=1)
        for name in self.schedules:
            SCHEDULES.get(name)
        if OPTIMIZERS.get(self.optimizer).adaptive:  # a compressor's momentum: twice
            specs = [
                c + ":momentum=0" if COMPRESSORS.get(compressor_name(c)).owns_momentum else c
                for c in self.compressions
            ]
            object.__setattr__(self, "compressions", tuple(specs))


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def candidates(space: SearchSpace, costs: ModelCosts, cluster: Cluster) -> Iterator[Configuration]:
    """Every configuration of ``space`` the model and the batch allow."""
    n, batch = space.ranks, space.batch_size
    nodes = cluster.nodes(n)
    if space.data_parallel and batch % n == 0:
        algorithms = ("flat", "hierarchical") if nodes > 1 and n > 1 else ("flat",)
        compressions = space.compressions if n > 1 else ("none",)
        pairs = [(c, DEFAULT_SYNC) for c in compressions]
        if n > 1:
            pairs += [("none", s) for s in space.syncs if parse_sync(s)[0].periodic]
        for compression, sync in pairs:
            for algorithm in algorithms:
                yield Configuration(
                    n,
                    batch,
                    compression=compression,
                    allreduce=algorithm,
                    optimizer=space.optimizer,
                    bucket_cap_mb=space.bucket_cap_mb,
                    sync=sync,
                )
    if not space.pipelines:
        return
    for d in _divisors(n):
        if d < 2:
            continue
        w = n // d
        if batch % w:
            continue
        for name in space.schedules:
            spec = SCHEDULES.get(name)
            if d * spec.stages_per_rank > costs.num_layers:
                continue
            for m in _divisors(batch // w):
                if space.max_microbatches is not None and m > space.max_microbatches:
                    break
                try:
                    check_microbatches(name, d, m, m_name="m", d_name="d")
                except ConfigError:
                    continue
                compressions = ("none",) if w == 1 else space.compressions
                for compression in compressions:
                    for recompute in (False, True):
                        yield Configuration(
                            n,
                            batch,
                            stages=d,
                            schedule=name,
                            microbatches=m,
                            recompute=recompute,
                            compression=compression,
                            optimizer=space.optimizer,
                        )


def search(space: SearchSpace, costs: ModelCosts, cluster: Cluster) -> list[Prediction]:
    """Every candidate predicted, best first (fitting ones by step time, then memory).

    Raises:
        ConfigError: no configuration at all (e.g. a batch no rank count divides).
    """
    found = [predict(costs, cluster, config) for config in candidates(space, costs, cluster)]
    if not found:
        raise ConfigError(
            f"no configuration of {space.ranks} ranks takes batch_size={space.batch_size}; "
            f"use a multiple of {space.ranks}"
        )
    return sorted(found, key=lambda p: _rank_key(p, space.tie))


def _rank_key(p: Prediction, tie: float = TIE) -> tuple[bool, float, int, float]:
    lossy = p.config.compression.split(":")[0] not in EXACT_COMPRESSIONS or p.config.periodic
    time = p.step_s * (1 + LOSSY_MARGIN if lossy else 1)
    bucket = round(math.log(max(time, 1e-12)) / math.log1p(tie)) if tie > 0 else time
    return (not p.fits, bucket, p.peak_bytes, time)


def to_json(predictions: Sequence[Prediction], cluster: Cluster, model_args: Sequence[str]) -> dict:
    """The ``syncline plan --json`` document: ``{"candidates": [...]}``, best first."""
    out = []
    for p in predictions:
        c = p.config
        out.append(
            {
                "label": c.describe(),
                "train_args": c.train_args(cluster.ranks_per_node),
                "model_args": list(model_args),
                "predicted_step_s": p.step_s,
                "predicted_samples_per_s": p.samples_per_s,
                "predicted_peak_bytes": p.peak_bytes,
                "predicted_bytes_per_rank": list(p.bytes_per_rank),
                "predicted_gradient_wire_bytes": p.gradient_wire_bytes,
                "fits": p.fits,
                "bottleneck": p.bottleneck,
                "breakdown_s": p.breakdown,
                "stages": c.stages,
                "width": c.width,
                "schedule": c.schedule,
                "microbatches": c.microbatches,
                "microbatch_size": c.microbatch_size,
                "recompute": c.recompute,
                "compression": c.compression,
                "allreduce": c.allreduce,
                "sync": c.sync,
                "balance": None if c.balance is None else list(c.balance),
            }
        )
    return {"cluster": cluster.to_dict(), "candidates": out}


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def table(predictions: Sequence[Prediction], top: int) -> str:
    """The ranked table ``syncline plan`` prints."""
    shown = predictions[:top]
    width = max([len("configuration"), *(len(p.config.describe()) for p in shown)])
    head = (
        f"{'#':>3}  {'configuration':<{width}} {'step':>10} {'samples/s':>11} {'peak/rank':>11}"
        f" {'grad wire':>11}  fits  bottleneck"
    )
    lines = [head, "-" * len(head)]
    for i, p in enumerate(shown, 1):
        step = f"{p.step_s * 1e3:.1f} ms" if p.step_s < 10 else f"{p.step_s:.2f} s"
        lines.append(
            f"{i:>3}  {p.config.describe():<{width}} {step:>10} {p.samples_per_s:>11.1f} "
            f"{_human(p.peak_bytes):>11} {_human(p.gradient_wire_bytes):>11}  "
            f"{'yes' if p.fits else 'NO ':<4}  {p.bottleneck}"
        )
    return "\n".join(lines)
