"""The pipeline training loop behind ``syncline train --pipeline-stages D`` (one call per rank).

Composition order: build the same full model on every rank (same seed), give each
data-parallel replica of the pipeline its data shard (every stage of one pipeline gets the
same batches), wrap the model in :class:`~syncline.pipeline.Pipeline` (which cuts it into
stages and keeps this rank's), then run warm-up + cosine-decayed steps. At the end every
rank flushes and sends its stage weights, optimizer state, memory statistics and the
recorded actions of the last ``TRACE_STEPS`` steps to rank 0, which writes the checkpoint of
the whole (unsplit) model, ``trace.json``, ``schedule.png``, the loss curve and the summary.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from syncline import comm
from syncline.comm.registry import build_allreduce
from syncline.comm.topology import Topology
from syncline.data import ShardedBatches
from syncline.data.user import KeywordInputs
from syncline.dp.compressors import build_compressor
from syncline.dp.precision import LossScaler
from syncline.errors import ConfigError
from syncline.extras import installed
from syncline.models.user import first_argument
from syncline.partition import balance as balance_costs
from syncline.pipeline import Pipeline
from syncline.schedule import Event, Timeline, bubble_fraction, to_chrome_trace
from syncline.train.checkpoint import save_checkpoint
from syncline.train.common import (
    build_datasets,
    build_model_for,
    layer_init_for,
    loss_for,
    lr_at,
    make_optimizer,
    rank_memory,
    set_lr,
)
from syncline.train.config import TrainConfig
from syncline.train.loop import Opening, Outputs, announce_resume, common_summary, write_summary
from syncline.train.metrics import MetricsLog, memory_summary, plot_loss
from syncline.train.plots import plot_schedule
from syncline.train.progress import human_bytes
from syncline.train.sample import Sample, sample_for
from syncline.train.state import (
    capture_pipeline,
    check_pipeline_optimizers,
    read_meta,
    restore_pipeline,
    same_pipeline_shape,
    stage_split,
)
from syncline.train.tensorboard_log import TensorBoardLog
from syncline.train.validation import Validation

#: Steps (the last ones) whose actions go into trace.json and schedule.png: enough to see
#: the steady state, bounded so that a long run does not write a huge file.
TRACE_STEPS = 3


def pipeline_groups(cfg: TrainConfig, world: int) -> tuple[comm.Group, comm.Group]:
    """``(pipeline group, data-parallel group)`` of this rank; ``None`` is the world.

    One pipeline (world size == stages) runs on the default group and has no replicas. With
    ``w`` replicas, :func:`syncline.comm.build_pipeline_groups` lays out global rank =
    stage * w + replica, so the replicas of a stage are neighbours (one node, fast links).
    """
    if world == cfg.pipeline.pipeline_stages:
        return None, None
    return comm.build_pipeline_groups(cfg.pipeline.pipeline_stages, timeout_s=cfg.timeout_s)


def build_pipeline(
    cfg: TrainConfig,
    model: nn.Module,
    device: torch.device,
    group: comm.Group,
    data_parallel_group: comm.Group = None,
    balance: list[int] | None = None,
    *,
    ranks_per_node: int | None = None,
) -> Pipeline:
    """The configured :class:`Pipeline` over ``model`` on ``group`` (this rank keeps its
    stages only), its stages averaged over ``data_parallel_group`` through the configured
    compressor when there are replicas. ``balance`` overrides the configured one (a resumed
    run cuts the model as the checkpointed run did)."""
    first_lr = lr_at(cfg, 0)
    compressor = build_compressor(cfg.dp.compression) if data_parallel_group is not None else None

    def optimizer(params: Any) -> torch.optim.Optimizer:
        opt = make_optimizer(cfg, list(params), compressor)
        set_lr([opt], first_lr)  # the stages are built in the first step when profiling
        return opt

    replica_allreduce, dp = None, cfg.dp
    if dp.allreduce != "flat" and data_parallel_group is not None:  # collective: every rank
        world = comm.group_size()
        per_node = Topology(world, ranks_per_node or dp.ranks_per_node or world).ranks_per_node
        replica_allreduce = build_allreduce(
            dp.allreduce, data_parallel_group, timeout_s=cfg.timeout_s, ranks_per_node=per_node
        )
    p = cfg.pipeline
    assert p.schedule is not None and p.microbatches is not None
    return Pipeline(
        model,
        num_stages=p.virtual_stages,
        num_microbatches=p.microbatches,
        schedule=p.schedule,
        loss_fn=loss_for(cfg),
        split_points=p.split_points,
        optimizer=optimizer,
        recompute=p.recompute,
        balance=balance or (None if p.balance is None else list(p.balance)),
        process_group=group,
        data_parallel_group=data_parallel_group,
        compression=compressor,
        timeout_s=cfg.timeout_s,
        device=device,
        track_memory=True,  # the run summary reports each stage's measured memory
        init=layer_init_for(cfg),
        seed=cfg.seed,
        precision=cfg.precision,
        replica_allreduce=replica_allreduce,
    )


class PipelineRunner:
    """One rank of a pipeline run: its stages of the model (a :class:`Pipeline`), the
    shard of the data its replica reads, and the meter of the bytes on the wire."""

    per_layer_failures = True

    def __init__(self, cfg: TrainConfig, rank: int, world: int, device: torch.device) -> None:
        self.cfg, self.rank, self.world, self.device = cfg, rank, world, device
        replicas = cfg.pipeline_replicas
        self.model = build_model_for(cfg, meta=True)  # each rank materialises its stages only
        if not isinstance(self.model, nn.Sequential) and cfg.pipeline.split_points is None:
            raise ConfigError(
                f"model {cfg.model!r} built a {type(self.model).__name__}; a pipeline cuts an "
                "nn.Sequential: valid: pipeline_stages=1, a model built as nn.Sequential, or "
                "--split-points"
            )
        self.dataset, self.held_out, self.tokens_per_sample = build_datasets(cfg)
        fed, held_fed = self.dataset, self.held_out
        if cfg.pipeline.split_points is not None:  # a traced model takes its inputs by name
            name = first_argument(self.model)
            fed = KeywordInputs(self.dataset, name)
            held_fed = None if self.held_out is None else KeywordInputs(self.held_out, name)
        # global rank = stage * replicas + replica: every stage of replica j reads shard j
        self.shard = ShardedBatches(fed, cfg.batch_size, rank % replicas, replicas, cfg.seed)
        self.validation = Validation(
            cfg, held_fed, rank % replicas, replicas, self.tokens_per_sample
        )
        self.start = 0
        self.trace_from = time.perf_counter()  # host time: the traced actions' clock
        self._batches: Iterator[tuple[torch.Tensor, torch.Tensor]] = iter(())
        self.pipe: Pipeline
        self.wire: _WireMeter
        self.ends: dict[int, int] = {}

    @classmethod
    def open(cls, at: Opening) -> PipelineRunner:
        """Build this rank's stages, cut as the checkpointed run was and continued from
        ``at.snap`` when there is one."""
        cfg, rank, world, device, store, snap = (
            at.cfg, at.rank, at.world, at.device, at.store, at.snap
        )  # fmt: skip
        runner = cls(cfg, rank, world, device)
        group, data_parallel = pipeline_groups(cfg, world)
        meta = read_meta(store, snap) if snap is not None else {}
        exact = same_pipeline_shape(meta, cfg, world)
        balance = None
        if cfg.pipeline.split_points is not None:
            pass  # cut where the config says, traced again below
        elif exact:  # cut as the checkpointed run was (its split was profiled)
            balance = list(meta["balance"])
        elif snap is not None and cfg.pipeline.balance is None:  # resharded: even, no profiling
            balance = balance_costs([1.0] * cfg.model_layers, cfg.pipeline.virtual_stages)
        runner.pipe = pipe = build_pipeline(
            cfg, runner.model, device, group, data_parallel, balance=balance,
            ranks_per_node=at.ranks_per_node,
        )  # fmt: skip
        if snap is not None:
            if cfg.pipeline.split_points is not None:  # traced on the batch the run continues with
                pipe.prepare(runner.shard.batch(int(meta["step"])))
            runner.start = restore_pipeline(store, snap, pipe, rank, meta, exact)
            announce_resume(rank, snap, runner.start, exact)
        runner.wire = _WireMeter(pipe, runner.start, cfg.timeout_s, device)
        runner.ends = _segment_ends(runner.start, cfg.steps, cfg.checkpoint.checkpoint_every or 0)
        return runner

    def step(self, step: int, lr: float) -> torch.Tensor:
        cfg = self.cfg
        if step in self.ends:  # 2BW takes no batch beyond a checkpoint step: it flushes there
            self._batches = itertools.islice(self.shard.batches(step), self.ends[step] - step)
        if step == max(0, cfg.steps - TRACE_STEPS):
            self.trace_from = time.perf_counter()
        if step:  # the first step builds the optimizers (with this lr) when it profiles
            set_lr(self.pipe.optimizers, lr)
        return self.pipe.train_step(self._batches, return_tensor=True)

    def validation_loss(self) -> float:
        # every rank; 2BW: on the newest weights, nothing disturbed
        return self.validation.pipeline_loss(self.pipe)

    def record_fields(self, step: int, *, final: bool) -> dict[str, Any]:
        # every rank: the job's bytes on the wire go into the record
        measured = self.wire.per_step(step, final=final)
        if measured is None:
            return {"wire_bytes": None, "wire_split": None, "wire_steps": None}
        return {
            "wire_bytes": sum(measured[0].values()),
            "wire_split": measured[0],
            "wire_steps": measured[1],
        }

    def capture(self, done: int) -> dict[str, torch.Tensor]:
        self.pipe.flush()  # 2BW: its batches ended here, so nothing is in flight
        assert self.cfg.pipeline.schedule is not None
        return capture_pipeline(
            done,
            self.pipe,
            self.rank,
            self.world,
            self.cfg.pipeline.schedule,
            self.cfg.pipeline.split_points,
        )

    def finish(self, outputs: Outputs) -> dict[str, Any]:
        cfg, pipe, rank = self.cfg, self.pipe, self.rank
        pipe.flush()
        data = self.dataset if self.held_out is None else self.held_out
        sample = _sample(cfg, pipe, data, self.tokens_per_sample, rank)
        gathered = comm.gather_objects(
            _rank_results(
                pipe, self.trace_from, self.device, weights=rank % cfg.pipeline_replicas == 0
            ),
            what="gather of stage weights and traces",
            timeout_s=cfg.timeout_s,
            device=self.device if self.device.type == "cuda" else None,
        )
        log, progress = outputs.log, outputs.progress
        if gathered is None or log is None or progress is None:
            return {}
        progress.close()
        return _finish(
            cfg, self.model, gathered, log, self.world, pipe.loss_scaler, outputs.board, sample
        )


def _sample(
    cfg: TrainConfig, pipe: Pipeline, dataset: Any, tokens: int, rank: int
) -> Sample | None:
    """The run's generated sample, on every rank of the pipeline together (each call of
    :meth:`Pipeline.predict` is a forward pass through all stages; its logits come back to
    every rank, which all draw the same next token from the same seed). A model that takes
    no plain token tensor (a traced model's dict of inputs, checked alike on every rank
    before anything is sent) gives no sample."""
    try:
        return sample_for(cfg, pipe.predict, dataset, tokens, torch.device("cpu"))
    except ConfigError as exc:
        if rank == 0:
            print(f"no sample: the pipeline takes no plain token tensor ({exc})", flush=True)
        return None


class _WireMeter:
    """The job's bytes on the wire per step: every rank's :attr:`Pipeline.wire_bytes`,
    summed over the ranks, as a rate over an interval of steps.

    [Note: no barrier at a logged step] A blocking allreduce at each logged step would make
    every rank wait for the slowest one there, and 2BW, whose stages run one batch apart
    (the first stage finishes batch t while the last already works on t+1), would lose the
    overlap it exists for at every logged step. So the sum is started without waiting, and
    collected one logged step later, when every rank has long issued it: a record carries
    the rate over the interval that ended at the *previous* logged step (``wire_steps``:
    ``[a, b]``, the steps ``a+1 .. b``); the last record waits, and covers the rest.
    """

    KINDS = ("activations", "gradients", "reduce")

    def __init__(self, pipe: Pipeline, start: int, timeout_s: float, device: torch.device):
        self._pipe, self._timeout_s, self._device = pipe, timeout_s, device
        self._last_step, self._last = start - 1, torch.zeros(3, dtype=torch.float64)
        self._inflight: tuple[int, comm.Pending, torch.Tensor] | None = None

    def per_step(self, step: int, final: bool) -> tuple[dict[str, int], list[int]] | None:
        """Start the sum at ``step``; the rate over the interval collected now (see the
        class docstring), or ``None`` when none is (the first record)."""
        mine = self._pipe.wire_bytes
        sent = torch.tensor([float(mine[k]) for k in self.KINDS], dtype=torch.float64)
        sent = sent.to(self._device)
        what = f"sum of the bytes on the wire at step {step}"
        pending = comm.FlatAllreduce(None, timeout_s=self._timeout_s).allreduce(sent, what)
        previous, self._inflight = self._inflight, (step, pending, sent)
        if final:
            if previous is not None:
                previous[1].wait()
            pending.wait()
            return self._rate(step, sent)
        if previous is None:
            return None
        previous[1].wait()
        return self._rate(previous[0], previous[2])

    def _rate(self, step: int, total: torch.Tensor) -> tuple[dict[str, int], list[int]]:
        total = total.cpu()
        per = (total - self._last) / (step - self._last_step)
        interval = [self._last_step, step]
        self._last_step, self._last = step, total
        return {k: round(float(v)) for k, v in zip(self.KINDS, per, strict=True)}, interval


def _segment_ends(start: int, steps: int, every: int) -> dict[int, int]:
    """``{first step: end step}`` of the runs of steps between checkpoints.

    A 2BW call starts the next batch early; feeding it an iterator that ends at each
    checkpoint step makes that call finish its batch without starting the next, so the
    checkpoint holds one weight version and no batch in flight. The uninterrupted run is
    cut at the same steps, so a resumed run continues it bit for bit. Flush schedules are
    unaffected (they never take a batch ahead).
    """
    cuts = [start, *range((start // every + 1) * every, steps, every)] if every else [start]
    return {a: b for a, b in zip(cuts, [*cuts[1:], steps], strict=True)}


def _rank_results(
    pipe: Pipeline, trace_from: float, device: torch.device, *, weights: bool
) -> dict[str, Any]:
    """What rank 0 needs from this rank: weights and optimizer states (``weights``: only
    replica 0 sends them, the other replicas hold the same), memory, and the actions run
    from ``trace_from`` on (``perf_counter`` time: every action of the last calls, whatever
    batch it belongs to, so that 2BW's overlap and the final flush are seen). Tensors go as
    CPU tensors: rank 0 unpickles them, and a CUDA tensor would land on the sender's GPU
    ordinal in rank 0's process (another rank's GPU, or none it can see)."""
    # peak memory of this rank so far, before anything is copied for rank 0
    memory = rank_memory(device)
    check_pipeline_optimizers(pipe)  # refused by name, not saved unreadable by rank 0
    events = [e for evs in pipe.trace(origin=0.0).events.values() for e in evs]
    optimizers = zip(pipe.stages, pipe.optimizers, strict=True) if weights else ()
    state = pipe.local_state_dict() if weights else {}
    return {
        "state": {k: v.cpu() for k, v in state.items()},
        "optimizers": {s: _on_cpu(o.state_dict()) for s, o in optimizers},
        "memory": {s: asdict(m) for s, m in pipe.memory_stats().items()},
        "balance": stage_split(pipe),
        "events": [e for e in events if e.start >= trace_from],
        "peak_memory": memory,
    }


def _on_cpu(obj: Any) -> Any:
    """``obj`` (an optimizer's ``state_dict()``) with every tensor copied to the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _on_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_on_cpu(v) for v in obj)
    return obj


def merge_timelines(name: str, per_rank: list[list[Event]], *, shared_clock: bool) -> Timeline:
    """One timeline of every rank's events, starting at 0.

    ``Pipeline.trace(origin=0.0)`` times are ``time.perf_counter()``, one clock for all
    processes of a machine; across machines (``shared_clock=False``) each rank is aligned
    at its own first event instead.
    """
    starts = [min((e.start for e in evs), default=0.0) for evs in per_rank]
    base = min(starts, default=0.0)
    events: dict[int, tuple[Event, ...]] = {}
    for rank, evs in enumerate(per_rank):
        origin = base if shared_clock else starts[rank]
        events[rank] = tuple(Event(rank, e.action, e.start - origin, e.end - origin) for e in evs)
    return Timeline(name, events)


def write_trace(timeline: Timeline, path: Path, stages_of: dict[int, list[int]]) -> Path:
    """Chrome/Perfetto trace JSON of ``timeline`` (seconds), one named row per rank."""
    trace = to_chrome_trace(timeline, us_per_unit=1e6)
    names: list[dict[str, object]] = [
        {
            "name": "thread_name",
            "ph": "M",
            "pid": 0,
            "tid": rank,
            "args": {"name": f"rank {rank}: stage {', '.join(map(str, stages))}"},
        }
        for rank, stages in stages_of.items()
    ]
    events = trace["traceEvents"]
    assert isinstance(events, list)
    trace["traceEvents"] = names + events
    path.write_text(json.dumps(trace) + "\n")
    return path


def _merge_states(gathered: list[dict[str, Any]], model: nn.Module) -> dict[str, torch.Tensor]:
    """Every rank's stage weights as ``model.state_dict()`` of the trained model: its keys,
    in its order. A name the stages do not hold takes the value of another name of the same
    tensor (BERT's ``cls.predictions.bias`` is its decoder's bias, which the stage keeps under
    that name); what the stages hold beside (buffers a checkpoint leaves out, such as BERT's
    position ids) is left out, so the result loads into the model strictly."""
    held: dict[str, torch.Tensor] = {}
    for result in gathered:
        held.update(result["state"])
    names: dict[int, list[str]] = {}
    wanted = model.state_dict(keep_vars=True)
    for key, tensor in wanted.items():
        names.setdefault(id(tensor), []).append(key)
    state: dict[str, torch.Tensor] = {}
    missing = []
    for key, tensor in wanted.items():
        found = next((held[k] for k in [key, *names[id(tensor)]] if k in held), None)
        if found is None:
            missing.append(key)
        else:
            state[key] = found
    if missing:
        raise RuntimeError(f"the stages sent no values for {missing[:5]} (of {len(missing)})")
    return state


def _finish(
    cfg: TrainConfig,
    model: nn.Module,
    gathered: list[dict[str, Any]],
    log: MetricsLog,
    world: int,
    scaler: LossScaler | None,
    board: TensorBoardLog | None = None,
    sample: Sample | None = None,
) -> dict[str, Any]:
    run_dir, p = Path(cfg.run_dir), cfg.pipeline
    optimizers = {s: o for r in gathered for s, o in r["optimizers"].items()}
    memory = {s: m for r in gathered for s, m in sorted(r["memory"].items())}
    ckpt = save_checkpoint(
        run_dir / "checkpoint.pt",
        {
            "model": _merge_states(gathered, model),
            "optimizers": optimizers,
            "config": cfg.to_dict(),
            "step": cfg.steps,
            "balance": gathered[0]["balance"],
        },
    )
    timeline = merge_timelines(
        str(p.schedule), [r["events"] for r in gathered], shared_clock=cfg.nnodes == 1
    )
    stages_of = {rank: sorted(r["memory"]) for rank, r in enumerate(gathered)}
    write_trace(timeline, run_dir / "trace.json", stages_of)
    first = max(0, cfg.steps - TRACE_STEPS)
    width = cfg.pipeline_replicas
    replicas = f" (replica 0 of {width})" if width > 1 else ""
    title = (
        f"{p.schedule}{' + recompute' if p.recompute else ''}: {p.virtual_stages} stages "
        f"on {p.pipeline_stages} ranks{replicas}, m={p.microbatches}, steps "
        f"{first}-{cfg.steps - 1} (measured)"
    )
    # one pipeline per chart: the replicas run the same schedule and would overlap in a row
    # (trace.json keeps every rank); replica 0 holds global ranks stage * width
    replica0 = {r: evs for r, evs in timeline.events.items() if r % width == 0}
    plot_schedule(Timeline(timeline.name, replica0), run_dir / "schedule.png", title)
    plot_loss(
        log.records,
        run_dir / "loss.png",
        f"{cfg.model} on {cfg.dataset}, {p.schedule} pipeline of {p.virtual_stages} stages",
    )
    summary = common_summary(cfg, log, world, model, scaler)
    for key in ("collectives_per_step", "median_exposed_comm_s"):
        summary.pop(key, None)
    summary.update(
        schedule=p.schedule,
        pipeline_stages=p.pipeline_stages,
        virtual_stages=p.virtual_stages,
        replicas=cfg.pipeline_replicas,
        microbatches=p.microbatches,
        recompute=p.recompute,
        balance=gathered[0]["balance"],
        split_points=p.split_points,
        memory=memory,
        traced_steps=[first, cfg.steps - 1],
        traced_bubble_fraction=bubble_fraction(timeline),
        **memory_summary([r["peak_memory"] for r in gathered]),
        traced_idle_per_rank={str(r): f for r, f in timeline.idle_fractions().items()},
        checkpoint=str(ckpt),
    )
    shown = write_summary(cfg, summary, sample, board)
    _print_summary(summary, run_dir, board is not None)
    if shown:
        print(shown.lstrip("\n"), flush=True)
    return summary


def _print_summary(summary: dict[str, Any], run_dir: Path, board: bool = False) -> None:
    plotted = installed("matplotlib")
    peak = max((m["peak_activation_bytes"] for m in summary["memory"].values()), default=0)
    idle = ", ".join(f"{f:.0%}" for f in summary["traced_idle_per_rank"].values())
    points = summary.get("split_points")
    cut = f"split at {', '.join(points)}" if points else f"balance {summary['balance']}"
    print(
        f"\nsummary: {summary['steps']} steps, {summary['schedule']} over "
        f"{summary['virtual_stages']} stages ({cut}), "
        f"m={summary['microbatches']} | loss {summary['first_loss']:.4f} -> "
        f"{summary['final_loss']:.4f} | {summary['median_samples_per_s']:.1f} samples/s, "
        f"{summary['median_tokens_per_s']:.0f} tokens/s (median) | stashed activations "
        f"{human_bytes(peak)} at most (largest stage) | idle "
        f"{summary['traced_bubble_fraction']:.0%} of the traced steps (per rank: {idle}) | "
        f"{human_bytes(summary['wire_bytes_per_step'])} on the wire/step | "
        f"{summary['elapsed_s']:.1f}s\n"
        f"run directory: {run_dir} (config.json, metrics.jsonl, "
        f"{'loss.png, ' if plotted else ''}checkpoint.pt, summary.json, trace.json"
        f"{', schedule.png' if plotted else ''}{', sample.txt' if 'sample' in summary else ''}"
        f"{', tensorboard/' if board else ''})",
        flush=True,
    )
