"""PURE: predict one configuration's step time and memory per rank from costs and a cluster.

Data parallelism (GradientFlow's setting): the forward, then the backward layer by layer
(last first); gradients fill buckets in that order (DDP's 1 MiB first bucket, then the cap)
and each bucket's collectives start once it is full and the previous one is done, so the
exposed communication is what the chain has left when the backward ends::

    t_step = F + B' + max(0, end_of_last_bucket - B') + update + overhead

with ``B'`` the backward slowed by the communication overlapping it (CPU ranks share their
cores with gloo's threads; ``Cluster.overlap_slowdown``).

Pipelines (PipeDream-2BW, section 4): the layers are balanced into stages (the same balancer
``syncline train`` uses), and the *same schedule the runtime executes* is run through the
schedule engine with each action priced: a forward or backward by its stage's layers at the
micro-batch size, a RECV by its message over the link, a REDUCE by the stage's gradient
allreduce over its replicas, a STEP by the optimizer. Flush schedules take the makespan of
one batch; 2BW, never flushed, the steady-state period between two STEPs.

Memory per rank, as the 2BW paper models it (section 4.1): weights times versions, their
gradients and optimizer state, the activations of the micro-batches in flight (counted on the
simulated schedule, so GPipe keeps m and 1F1B ``d - r``; with recomputation only their inputs
plus one micro-batch's activations), plus what the framework holds before any model.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from syncline.dp.registry import COMPRESSORS, compressor_name
from syncline.dp.syncs import DEFAULT_SYNC, parse_sync
from syncline.errors import ConfigError
from syncline.optim.registry import OPTIMIZERS
from syncline.partition import balance as balance_layers
from syncline.partition import check_balance, stage_bounds
from syncline.planner.collectives import Phase, bucket_phases, phases_s
from syncline.planner.costs import ModelCosts
from syncline.planner.hardware import Cluster, Link
from syncline.planner.timeline import Compiled, compile_schedule
from syncline.registry import resolve
from syncline.schedule import SCHEDULES, ActionKind, add_communication, two_bw
from syncline.schedule.ir import Action, Schedule
from syncline.schedule.registry import build_plan

__all__ = ["Configuration", "Prediction", "predict"]

MiB = 2**20


@dataclass(frozen=True)
class Configuration:
    """One way to run a model on ``ranks`` ranks: data parallel, or a pipeline of ``stages``
    ranks deep and ``ranks // stages`` wide."""

    ranks: int
    batch_size: int
    stages: int = 1
    schedule: str | None = None
    microbatches: int | None = None
    recompute: bool = False
    compression: str = "none"
    allreduce: str = "flat"
    balance: tuple[int, ...] | None = None
    bucket_cap_mb: float = 25.0
    first_bucket_cap_mb: float = 1.0
    optimizer: str = "adamw"
    sync: str = DEFAULT_SYNC

    def __post_init__(self) -> None:
        if self.ranks < 1 or self.stages < 1 or self.ranks % self.stages:
            raise ConfigError(f"stages={self.stages} must divide ranks={self.ranks} (both >= 1)")
        if self.periodic and self.stages > 1:
            raise ConfigError(f"sync={self.sync!r} is for data parallelism, not pipelines")
        if self.stages > 1:
            if self.schedule is None or self.microbatches is None:
                raise ConfigError("a pipeline configuration needs schedule and microbatches")
            if self.batch_size % (self.width * self.microbatches):
                raise ConfigError(
                    f"batch_size={self.batch_size} does not split into {self.width} "
                    f"replica(s) x {self.microbatches} micro-batches"
                )
        elif self.batch_size % self.ranks:
            raise ConfigError(f"batch_size={self.batch_size} is not a multiple of {self.ranks}")
        OPTIMIZERS.get(self.optimizer)  # an unknown one: named, with the registered ones

    @property
    def periodic(self) -> bool:
        """Whether the replicas synchronise every few steps rather than every step."""
        return parse_sync(self.sync)[0].periodic

    @property
    def width(self) -> int:
        """Data-parallel replicas (of each stage, for a pipeline)."""
        return self.ranks // self.stages

    @property
    def microbatch_size(self) -> int:
        if self.stages == 1:
            return self.batch_size // self.ranks
        assert self.microbatches is not None
        return self.batch_size // (self.width * self.microbatches)

    def describe(self) -> str:
        """A short label, e.g. ``dp csc:0.01`` or ``pp 2x1 2bw m=8 recompute``."""
        if self.stages == 1:
            algo = "" if self.allreduce == "flat" else f" {self.allreduce}"
            sync = f" sync {self.sync}" if self.periodic else ""
            return f"dp {self.compression}{algo}{sync}"
        text = f"pp {self.stages}x{self.width} {self.schedule} m={self.microbatches}"
        if self.recompute:
            text += " recompute"
        if self.width > 1 and self.compression != "none":
            text += f" {self.compression}"
        return text

    def train_args(self, ranks_per_node: int) -> list[str]:
        """The ``syncline train`` options that run exactly this configuration (to append to
        the model's own options). Over several nodes, each node adds its ``--node-rank`` and
        the ``--rdzv-endpoint`` of node 0."""
        per_node = min(ranks_per_node, self.ranks)
        args = [f"--nproc-per-node={per_node}"]
        if self.ranks > per_node:
            args.append(f"--nnodes={self.ranks // per_node}")
        args.append(f"--batch-size={self.batch_size}")
        args.append(f"--optimizer={self.optimizer}")
        if self.compression != "none":
            args.append(f"--compression={self.compression}")
        if self.stages == 1:
            args.append(f"--bucket-cap-mb={self.bucket_cap_mb:g}")
            if self.periodic:
                args.append(f"--sync={self.sync}")
            if self.allreduce != "flat":
                args.append(f"--allreduce={self.allreduce}")
            return args
        args += [
            f"--pipeline-stages={self.stages}",
            f"--schedule={self.schedule}",
            f"--microbatches={self.microbatches}",
        ]
        if self.recompute:
            args.append("--recompute")
        if self.balance is not None:
            args.append("--balance=" + ",".join(str(n) for n in self.balance))
        return args


@dataclass(frozen=True)
class Prediction:
    """What the cost model predicts for a configuration.

    Attributes:
        config: the configuration (``balance`` resolved for pipelines).
        step_s: seconds per training step (one global batch).
        samples_per_s: global batch over ``step_s``.
        peak_bytes: the largest rank's predicted peak memory.
        bytes_per_rank: predicted peak memory of each rank of one pipeline (DP: one entry).
        fits: whether every rank fits in the cluster's memory.
        bottleneck: what the step spends most of its time on (``memory`` when it does not fit).
        breakdown: seconds per part (compute, bubble, allreduce, messages, update, overhead).
        gradient_wire_bytes: bytes one rank puts into its gradient collectives per step,
            from the compressor's traffic model (a pipeline: its busiest stage's REDUCE).
    """

    config: Configuration
    step_s: float
    samples_per_s: float
    peak_bytes: int
    bytes_per_rank: tuple[int, ...]
    fits: bool
    bottleneck: str
    breakdown: dict[str, float] = field(default_factory=dict)
    gradient_wire_bytes: float = 0.0


def _optimizer_states(config: Configuration) -> int:
    spec = OPTIMIZERS.get(config.optimizer)
    if spec.takes_momentum and COMPRESSORS.get(compressor_name(config.compression)).owns_momentum:
        return max(0, spec.state_buffers - 1)  # the compressor carries the momentum
    return spec.state_buffers


def _compressor_states(name: str) -> int:
    """Gradient-sized buffers the compressor keeps per parameter."""
    return COMPRESSORS.get(name).state_buffers


def _transient(name: str) -> float:
    """Bytes per element of the largest bucket the compressor allocates while reducing
    it, freed afterwards."""
    return COMPRESSORS.get(name).transient_bytes


def _state_bytes(params: int, costs: ModelCosts, config: Configuration, versions: int) -> float:
    """Weights (times versions), gradients, mixed precision's master copy (one: 2BW's
    second version is of the 16-bit weights the stages compute with), optimizer state
    and compressor state."""
    per = costs.param_bytes
    compressor = compressor_name(config.compression) if config.width > 1 else "none"
    states = _optimizer_states(config) + _compressor_states(compressor)
    states += parse_sync(config.sync)[0].state_buffers  # DiLoCo: outer weights, momentum
    return params * (per * versions + per + costs.master_bytes + 4 * states)


def _finish(
    config: Configuration,
    costs: ModelCosts,
    cluster: Cluster,
    step_s: float,
    per_rank: Sequence[float],
    breakdown: dict[str, float],
    wire: float = 0.0,
    head_bound: bool = False,
) -> Prediction:
    workspace = costs.workspace.at(config.microbatch_size) + cluster.workspace
    per_rank_bytes = tuple(int(cluster.base_memory + workspace + b) for b in per_rank)
    peak = max(per_rank_bytes)
    fits = peak <= cluster.memory_per_rank
    parts = {k: v for k, v in breakdown.items() if k != "overhead"}
    bottleneck = "memory" if not fits else max(parts, key=lambda k: parts[k])
    if bottleneck in ("compute", "bubble") and head_bound:
        bottleneck = "head"
    return Prediction(
        config=config,
        step_s=step_s,
        samples_per_s=config.batch_size / step_s if step_s > 0 else 0.0,
        peak_bytes=peak,
        bytes_per_rank=per_rank_bytes,
        fits=fits,
        bottleneck=bottleneck,
        breakdown=breakdown,
        gradient_wire_bytes=wire,
    )


def _buckets(costs: ModelCosts, config: Configuration) -> list[tuple[int, list[int]]]:
    """Gradient buckets in backward order: (elements, layer indices), layer granularity."""
    caps = [config.first_bucket_cap_mb * MiB, config.bucket_cap_mb * MiB]
    buckets: list[tuple[int, list[int]]] = []
    numel, members = 0, []
    for index in reversed(range(costs.num_layers)):
        layer = costs.layers[index]
        if not layer.params:
            continue
        numel += layer.params
        members.append(index)
        if numel * costs.param_bytes >= caps[min(len(buckets), 1)]:
            buckets.append((numel, members))
            numel, members = 0, []
    if members:
        buckets.append((numel, members))
    return buckets


def predict_data_parallel(costs: ModelCosts, cluster: Cluster, config: Configuration) -> Prediction:
    """Data parallelism over all ranks (``config.stages == 1``).

    With a periodic ``sync`` (local SGD, DiLoCo) the steady state averages no gradient: each
    step pays, not overlapped, its share of one weight-sized allreduce every ``period``
    steps (bytes and time over the period; the dense warm-up is left out, as a compressor's
    is)."""
    b = config.microbatch_size
    ranks = list(range(config.ranks))
    forward = sum(layer.forward.at(b) for layer in costs.layers) + costs.loss.at(b)
    backward_of = {i: layer.backward.at(b) for i, layer in enumerate(costs.layers)}
    backward = sum(backward_of.values())
    name = compressor_name(config.compression)
    compress = cluster.compress_s_per_byte.get(name, 0.0)
    buckets = [] if config.periodic else _buckets(costs, config)

    def chain(slowdown: float) -> tuple[float, float, float]:
        """(backward end, last bucket end, communication inside the backward)."""
        t, ready = 0.0, {}
        for i in reversed(range(costs.num_layers)):
            t += backward_of[i] * (1 + slowdown)
            ready[i] = t
        end, inside, total = 0.0, 0.0, 0.0
        for numel, members in buckets:
            matrices = [m for i in members for m in costs.layers[i].matrices]
            phases = bucket_phases(config.compression, numel, matrices, costs.param_bytes)
            span = phases_s(phases, ranks, cluster, config.allreduce, cluster.reduce_s_per_byte)
            span += compress * numel * costs.param_bytes
            start = max(end, ready[min(members)])
            end = start + span
            inside += max(0.0, min(end, t) - start)
            total += span
        return t, end, inside

    wire = 0.0
    if config.ranks > 1:
        for numel, members in buckets:
            matrices = [m for i in members for m in costs.layers[i].matrices]
            phases = bucket_phases(config.compression, numel, matrices, costs.param_bytes)
            wire += sum(p.nbytes for p in phases)
    bwd_end, comm_end, inside = chain(0.0)
    if cluster.overlap_slowdown and config.ranks > 1 and backward > 0:
        slowdown = cluster.overlap_slowdown * inside / backward
        bwd_end, comm_end, inside = chain(slowdown)
    exposed = max(0.0, comm_end - bwd_end) if config.ranks > 1 else 0.0
    sync_s, sync_wire = _periodic_sync(costs, cluster, config)
    exposed += sync_s
    wire += sync_wire
    update = costs.update_s_per_param * costs.params
    overhead = cluster.step_overhead_s
    step = forward + bwd_end + exposed + update + overhead
    activations = sum(layer.activation_bytes for layer in costs.layers) * b
    largest = max((numel for numel, _ in buckets), default=0)
    compressor = compressor_name(config.compression) if config.ranks > 1 else "none"
    transient = _transient(compressor) * largest
    memory = (
        _state_bytes(costs.params, costs, config, 1)
        + activations
        + costs.input_bytes * b
        + transient
    )
    breakdown = {
        "compute": forward + backward,
        "slowdown": bwd_end - backward,
        "allreduce": exposed,
        "update": update,
        "overhead": overhead,
    }
    return _finish(config, costs, cluster, step, [memory], breakdown, wire)


def _periodic_sync(
    costs: ModelCosts, cluster: Cluster, config: Configuration
) -> tuple[float, float]:
    """Seconds and bytes per step of a periodic sync's synchronisations (0 without one)."""
    entry, values = parse_sync(config.sync)
    if not entry.periodic or config.ranks == 1:
        return 0.0, 0.0
    if entry.traffic is None:
        raise ConfigError(f"sync={config.sync!r}: the planner has no traffic model for it")
    traffic, every = resolve(entry.traffic)(costs.params, costs.param_bytes, **values)
    phases = [Phase(kind, nbytes) for kind, nbytes in traffic]
    ranks = list(range(config.ranks))
    span = phases_s(phases, ranks, cluster, config.allreduce, cluster.reduce_s_per_byte)
    return span / every, sum(p.nbytes for p in phases) / every


def _stage_layers(costs: ModelCosts, config: Configuration, stages: int) -> list[list[int]]:
    b = config.microbatch_size
    if config.balance is None:
        per = [layer.forward.at(b) + layer.backward.at(b) for layer in costs.layers]
        per[-1] += costs.loss.at(b)
        sizes = balance_layers(per, stages)
    else:
        sizes = check_balance(list(config.balance), costs.num_layers, stages)
    return [list(range(lo, hi)) for lo, hi in stage_bounds(sizes)]


@dataclass(frozen=True)
class _Generated:
    """A schedule and what pricing it needs, computed once per shape."""

    schedule: Schedule
    compiled: Compiled
    steady: bool
    """Never flushed (2BW): read the period between STEPs, not the makespan."""
    held: tuple[dict[int, int], ...]
    """Per rank: the most micro-batches each of its stages holds between F and B."""
    work: tuple[dict[tuple[ActionKind, int], int], ...]
    """Per rank: how many F, B and RECOMPUTE of each stage it runs (per batch)."""
    steps: tuple[tuple[int, ...], ...]
    """Per rank: positions of its STEPs."""


_WORK = frozenset({ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.RECOMPUTE})
_TWO_BW_BATCHES = 4


@functools.lru_cache(maxsize=256)
def _generated(name: str, d: int, stages: int, m: int, recompute: bool) -> _Generated:
    """The schedule the runtime runs (2BW: four batches, to read its steady state)."""
    steady = SCHEDULES.get(name).versioned
    if steady:
        schedule = add_communication(two_bw(d, m, _TWO_BW_BATCHES, recompute=recompute))
    else:
        schedule = build_plan(name, d, stages, m, recompute=recompute).schedule
    batches = _TWO_BW_BATCHES if steady else 1
    held, work, steps = [], [], []
    for rank in sorted(schedule.actions):
        acts = schedule.actions[rank]
        held.append(_in_flight(acts))
        counts: dict[tuple[ActionKind, int], int] = {}
        for a in acts:
            if a.kind in _WORK:
                counts[a.kind, a.stage] = counts.get((a.kind, a.stage), 0) + 1
        work.append({k: -(-v // batches) for k, v in counts.items()})
        steps.append(tuple(i for i, a in enumerate(acts) if a.kind is ActionKind.STEP))
    return _Generated(
        schedule, compile_schedule(schedule), steady, tuple(held), tuple(work), tuple(steps)
    )


def _in_flight(actions: Sequence[Action]) -> dict[int, int]:
    """The most micro-batches each stage of a rank holds between forward and backward."""
    live: dict[int, int] = {}
    peak: dict[int, int] = {}
    for a in actions:
        if a.kind is ActionKind.FORWARD:
            live[a.stage] = live.get(a.stage, 0) + 1
            peak[a.stage] = max(peak.get(a.stage, 0), live[a.stage])
        elif a.kind is ActionKind.BACKWARD:
            live[a.stage] -= 1
    return peak


@dataclass(frozen=True)
class _Stages:
    """Per (virtual) stage: its layers and what one micro-batch costs there."""

    layers: list[list[int]]
    forward: list[float]
    backward: list[float]
    params: list[int]
    out_bytes: list[float]
    activation_bytes: list[float]
    input_bytes: list[float]


def _stages(costs: ModelCosts, cluster: Cluster, config: Configuration, n: int) -> _Stages:
    b = config.microbatch_size
    layers = _stage_layers(costs, config, n)
    fwd = [
        sum(costs.layers[i].forward.at(b) for i in s) + cluster.microbatch_overhead_s
        for s in layers
    ]
    fwd[-1] += costs.loss.at(b)
    out = [costs.layers[s[-1]].output_bytes * b for s in layers]
    return _Stages(
        layers=layers,
        forward=fwd,
        backward=[sum(costs.layers[i].backward.at(b) for i in s) for s in layers],
        params=[sum(costs.layers[i].params for i in s) for s in layers],
        out_bytes=out,
        activation_bytes=[sum(costs.layers[i].activation_bytes for i in s) * b for s in layers],
        input_bytes=[costs.input_bytes * b, *out[:-1]],
    )


def predict_pipeline(costs: ModelCosts, cluster: Cluster, config: Configuration) -> Prediction:
    """A pipeline of ``config.stages`` ranks times ``config.width`` replicas."""
    assert config.schedule is not None and config.microbatches is not None
    spec = SCHEDULES.get(config.schedule)
    n = config.stages * spec.stages_per_rank
    if n > costs.num_layers:
        raise ConfigError(f"{n} stages need at least {n} layers, not {costs.num_layers}")
    d, w, m = config.stages, config.width, config.microbatches
    st = _stages(costs, cluster, config, n)
    config = replace(config, balance=tuple(len(s) for s in st.layers))
    gen = _generated(config.schedule, d, n, m, config.recompute)

    def rank_of(stage: int) -> int:
        return stage % d

    def link_of(a: int, b: int) -> Link:
        # rank = pipeline rank * width + replica: replica 0's pipeline is ranks 0, w, 2w, ...
        ra, rb = rank_of(a) * w, rank_of(b) * w
        if ra // cluster.ranks_per_node == rb // cluster.ranks_per_node:
            return cluster.intra
        # across nodes, the stage's replicas on one node send at once over its ports
        return cluster.inter_shared(min(w, cluster.ranks_per_node))

    compress = cluster.compress_s_per_byte.get(compressor_name(config.compression), 0.0)

    def reduce_s(stage: int) -> float:
        if w == 1:
            return 0.0
        replicas = [rank_of(stage) * w + j for j in range(w)]
        phases = bucket_phases(config.compression, st.params[stage], (), costs.param_bytes)
        span = phases_s(phases, replicas, cluster, "flat", cluster.reduce_s_per_byte)
        return span + compress * st.params[stage] * costs.param_bytes

    copy = cluster.update_s_per_byte * costs.param_bytes if spec.versioned else 0.0
    update_of = [(costs.update_s_per_param + copy) * p for p in st.params]
    reduce_of = [reduce_s(s) for s in range(n)]
    K = ActionKind
    priced: dict[tuple[ActionKind, int], float] = {}
    delays: dict[tuple[ActionKind, int], float] = {}
    for s in range(n):
        priced[K.FORWARD, s] = priced[K.RECOMPUTE, s] = st.forward[s]
        priced[K.BACKWARD, s] = st.backward[s]
        priced[K.REDUCE, s] = reduce_of[s]
        priced[K.STEP, s] = update_of[s]
        if s > 0:
            delays[K.RECV_F, s] = link_of(s - 1, s).time(st.out_bytes[s - 1])
        if s < n - 1:
            delays[K.RECV_B, s] = link_of(s + 1, s).time(st.out_bytes[s])
    slots = gen.compiled.slots
    ends = gen.compiled.run(
        [priced.get(k, 0.0) for k in slots], [delays.get(k, 0.0) for k in slots]
    )
    if gen.steady:
        span = max(
            (e[p[-1]] - e[p[0]]) / (len(p) - 1) for e, p in zip(ends, gen.steps, strict=True)
        )
    else:
        span = max(max(e) for e in ends if e)
    busy = max(sum(priced[k] * c for k, c in work.items()) for work in gen.work)
    versions = 2 if spec.versioned else 1
    per_rank = []
    for rank in range(d):
        total = 0.0
        for s in range(rank, n, d):
            held = gen.held[rank].get(s, 0)
            kept = st.input_bytes[s] + (0.0 if config.recompute else st.activation_bytes[s])
            total += held * kept + (st.activation_bytes[s] if config.recompute else 0.0)
            total += _state_bytes(st.params[s], costs, config, versions)
            if config.width > 1:  # the REDUCE compresses the stage's gradient in one buffer
                name = compressor_name(config.compression)
                total += _transient(name) * st.params[s]
        per_rank.append(total)
    hops = [link_of(s, s + 1).time(st.out_bytes[s]) for s in range(n - 1)]
    messages = 2 * m * max(hops, default=0.0)
    update, reduce = max(update_of), max(reduce_of)
    breakdown = {
        "compute": busy,
        "bubble": max(0.0, span - busy - update - reduce - messages),
        "allreduce": reduce,
        "update": update,
        "messages": messages,
        "overhead": cluster.step_overhead_s,
    }
    wire = 0.0
    if w > 1:
        wire = max(
            sum(
                p.nbytes
                for p in bucket_phases(config.compression, st.params[s], (), costs.param_bytes)
            )
            for s in range(n)
        )
    step_s = span + cluster.step_overhead_s
    work = [f + bwd for f, bwd in zip(st.forward, st.backward, strict=True)]
    # the stage holding the head is the slowest by more than a tie: the head is what binds
    others = max(work[:-1], default=0.0)
    head_bound = costs.layers[-1].name == "head" and work[-1] > others * 1.01
    return _finish(config, costs, cluster, step_s, per_rank, breakdown, wire, head_bound)


def predict(costs: ModelCosts, cluster: Cluster, config: Configuration) -> Prediction:
    """Predict ``config`` (data parallel when ``stages == 1``, else a pipeline).

    Raises:
        ConfigError: a configuration the model or schedule cannot take, naming it.
    """
    if config.stages == 1:
        return predict_data_parallel(costs, cluster, config)
    return predict_pipeline(costs, cluster, config)
