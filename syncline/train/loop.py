"""The one training loop of ``syncline train``, over a :class:`Runner` per layout.

Data parallelism (:class:`~syncline.train.trainer.DataParallelRunner`) and pipelines
(:class:`~syncline.train.pipeline_trainer.PipelineRunner`) differ in how a step runs, what
a checkpoint holds and what the summary reports; the loop around them is the same: learning
rate schedule, injected failures, validation, metrics and progress on rank 0, periodic
checkpoints, then the final checkpoint and summary. It is written once, here, so a feature
of the loop (a guard, a new metric) reaches both layouts.
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from syncline.comm.collectives import Collective
from syncline.comm.device import Stopwatch
from syncline.dp.precision import LossScaler, scaler_summary
from syncline.errors import CheckpointWriteError
from syncline.train.common import arm_failure, fail_if_injected, lr_at
from syncline.train.config import TrainConfig
from syncline.train.guarding import GuardStop, GuardWatch
from syncline.train.metrics import MetricsLog, summarize, timed_record
from syncline.train.progress import Progress, human_bytes
from syncline.train.sample import Sample, record_sample
from syncline.train.snapshots import Snapshot, SnapshotStore
from syncline.train.tensorboard_log import TensorBoardLog
from syncline.train.validation import Validation

__all__ = ["Opening", "Outputs", "Runner", "common_summary", "train", "write_summary"]


class Outputs:
    """Rank 0's records of the run (``None`` on the other ranks): the metrics log, the
    progress lines and the TensorBoard writer."""

    def __init__(self, cfg: TrainConfig, rank: int, start: int, *, pipelined: bool) -> None:
        run_dir = Path(cfg.run_dir)
        first = rank == 0
        self.log = MetricsLog(run_dir / "metrics.jsonl", resume_at=start) if first else None
        self.progress = Progress(cfg.steps) if first else None
        self.board = (
            TensorBoardLog.open(run_dir, pipelined=pipelined) if first and cfg.tensorboard else None
        )


@dataclass(frozen=True)
class Opening:
    """What a :class:`Runner` is opened with: one object, so that the two layouts' ``open``
    take the same thing and a new input reaches both without a second signature."""

    cfg: TrainConfig
    rank: int
    world: int
    device: torch.device
    store: SnapshotStore
    #: the checkpoint to continue from, or ``None`` for a fresh run
    snap: Snapshot | None
    #: the gradients' allreduce (data parallelism), from the launcher-facing caller
    allreduce: str | Collective = "flat"
    #: the node size a hierarchical allreduce of a pipeline's replicas uses (default the world)
    ranks_per_node: int | None = None


class Runner(Protocol):
    """One layout's part of the loop; built, and resumed from a checkpoint, by its own
    ``open`` (see the two implementations)."""

    #: the modules a ``forward``-phase injected failure arms (per layer in a pipeline)
    model: nn.Module
    per_layer_failures: bool
    device: torch.device
    validation: Validation
    tokens_per_sample: int
    start: int

    def step(self, step: int, lr: float) -> torch.Tensor:
        """Train on batch ``step`` at learning rate ``lr``; the loss, on the device."""
        ...

    def validation_loss(self) -> float:
        """The held-out loss, averaged over the ranks (every rank calls it)."""
        ...

    def record_fields(self, step: int, *, final: bool) -> dict[str, Any]:
        """Extra fields of the metrics record at a logged ``step`` (every rank calls it:
        a pipeline sums the bytes on the wire over the ranks); ``"progress_wire"`` is what
        the progress line shows as bytes per step."""
        ...

    def capture(self, done: int) -> dict[str, torch.Tensor]:
        """This rank's part of the checkpoint after ``done`` steps."""
        ...

    def finish(self, outputs: Outputs) -> dict[str, Any]:
        """After the last step: the final checkpoint, plots and summary (complete on rank
        0, ``{}`` elsewhere)."""
        ...


def announce_resume(rank: int, snap: Snapshot, start: int, exact: bool) -> None:
    """Rank 0's line saying where the run continues from."""
    if rank == 0:
        how = "" if exact else ", resharded: fresh RNG and compressor state"
        print(f"resumed from {snap.path} (step {start}{how})", flush=True)


def train(
    cfg: TrainConfig,
    rank: int,
    world: int,
    device: torch.device,
    *,
    allreduce: str | Collective = "flat",
    ranks_per_node: int | None = None,
    attempt: int = 0,
) -> dict[str, Any]:
    """Train on this rank; returns the run summary (complete on rank 0).

    ``allreduce`` (data parallelism) and ``ranks_per_node`` (a pipeline's replicas) come
    from the launcher-facing caller. ``attempt``: torchrun's restart count; a restarted
    attempt, like ``--resume``, continues from the newest checkpoint.
    """
    store = SnapshotStore(
        Path(cfg.run_dir) / "checkpoints",
        keep=cfg.checkpoint.keep_checkpoints,
        timeout_s=cfg.timeout_s,
        device=device,
    )
    snap = None
    if cfg.checkpoint.resume is not None or attempt > 0:  # the newest that verifies
        snap = store.newest_intact(functools.partial(print, flush=True) if rank == 0 else None)
    at = Opening(cfg, rank, world, device, store, snap, allreduce, ranks_per_node)
    runner: Runner
    if cfg.pipeline.pipelined:
        from syncline.train.pipeline_trainer import PipelineRunner

        runner = PipelineRunner.open(at)
    else:
        from syncline.train.trainer import DataParallelRunner

        runner = DataParallelRunner.open(at)
    outputs = Outputs(cfg, rank, runner.start, pipelined=cfg.pipeline.pipelined)
    guard = GuardWatch(cfg.guard, getattr(runner, "guard", None), runner.device)
    try:
        _steps(cfg, rank, runner, store, outputs, attempt, guard)
    except GuardStop as stop:
        return _stopped(cfg, rank, outputs, guard, str(stop))
    summary = runner.finish(outputs)
    if guard.guard is not None and summary:  # rank 0: the events join summary.json
        summary.update(guard.summary())
        (Path(cfg.run_dir) / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        print(_guard_line(guard), flush=True)
    return summary


def _guard_line(guard: GuardWatch) -> str:
    events = guard.events
    steps = ", ".join(str(e.step) for e in events) or "none"
    return f"guard ({guard.config.on_nonfinite}): {len(events)} event(s) at step(s) {steps}"


def _stopped(
    cfg: TrainConfig, rank: int, outputs: Outputs, guard: GuardWatch, line: str
) -> dict[str, Any]:
    """``--on-nonfinite stop`` fired: rank 0 prints the one line and writes summary.json
    (what was logged, the events, ``stopped``); no checkpoint is written."""
    if rank != 0 or outputs.log is None:
        return {}
    if outputs.progress is not None:
        outputs.progress.close()
    print(line, flush=True)
    for event in guard.events:
        guard.write(outputs.log.path, event)
    summary = {**summarize(outputs.log.records), **guard.summary(), "stopped": line}
    (Path(cfg.run_dir) / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if outputs.board is not None:
        outputs.board.close(summary, cfg.steps - 1)
    return summary


def _steps(
    cfg: TrainConfig,
    rank: int,
    runner: Runner,
    store: SnapshotStore,
    outputs: Outputs,
    attempt: int,
    guard: GuardWatch,
) -> None:
    """The step loop from ``runner.start`` to ``cfg.steps`` (a rollback goes back)."""
    log, progress, board = outputs.log, outputs.progress, outputs.board
    t_start = time.perf_counter()  # wall clock: the elapsed time and the ETA
    watch = Stopwatch(runner.device)  # the step's time on its device
    step = runner.start
    while step < cfg.steps:
        fail_if_injected(cfg, rank, step, attempt)
        armed = arm_failure(
            cfg, rank, step, attempt, runner.model, per_layer=runner.per_layer_failures
        )
        watch.start()
        lr = lr_at(cfg, step)
        loss = runner.step(step, lr)  # on the device: read only when logged
        for handle in armed:
            handle.remove()
        watch.stop()
        validated: dict[str, float] = {}
        if runner.validation.due(step):  # every rank: the loss is averaged over them
            validated = runner.validation.metrics(runner.validation_loss())
        final = step == cfg.steps - 1
        if step % cfg.log_every == 0 or final or validated:
            fields = runner.record_fields(step, final=final)
            wire = fields.pop("progress_wire", None)
            if log is not None and progress is not None:
                value = float(loss.item())
                record = timed_record(
                    step,
                    value,
                    lr,
                    samples=cfg.batch_size,
                    tokens_per_sample=runner.tokens_per_sample,
                    step_s=watch.elapsed_s(),
                    run_started=t_start,
                    val_loss=validated.get("val_loss"),
                    val_ppl=validated.get("val_ppl"),
                    **fields,
                )
                log.append(record)
                if board is not None:
                    board.add(record)
                progress.update(
                    step,
                    value,
                    record.samples_per_s,
                    record.tokens_per_s,
                    wire,
                    step_s=record.step_s,
                )
                if validated:
                    progress.validation(step, validated)
        done = step + 1
        verdict = guard.after_step(step)  # the previous step's, read one step late
        if verdict is None and (cfg.checkpoint_due(done) or done == cfg.steps):
            verdict = guard.settle_now()  # this step's: nothing is saved past an event
        if verdict is not None:
            back_to = _handle(cfg, rank, runner, store, outputs, guard, verdict)
            if back_to is not None:
                step = back_to
                continue
        if cfg.checkpoint_due(done):
            t_save = time.perf_counter()
            path = _checkpoint(cfg, rank, step, attempt, runner, store, progress)
            if path is not None and progress is not None:  # rank 0
                size = sum(f.stat().st_size for f in path.iterdir())
                progress.note(
                    f"checkpoint of step {done}: {human_bytes(size)} in "
                    f"{time.perf_counter() - t_save:.2f}s -> {path}"
                )
        step = done


def _handle(
    cfg: TrainConfig,
    rank: int,
    runner: Runner,
    store: SnapshotStore,
    outputs: Outputs,
    guard: GuardWatch,
    verdict: dict[str, float],
) -> int | None:
    """Act on an event the host just learned of; the step to go back to (``rollback``).

    ``skip``: its update was already dropped on the device; recorded, the loop goes on.
    ``stop``: :class:`GuardStop` on every rank (the event is agreed). ``rollback``: the
    newest checkpoint is restored and batches are left out of the data stream.
    """
    action, event_step = cfg.guard.on_nonfinite, int(verdict["step"])
    if action == "stop":
        raise GuardStop(guard.stop_line(verdict, rank, cfg.timeout_s, runner.device))
    back_to, note = None, ""
    if action == "skip":
        event = guard.event(verdict)
    else:
        guard.forget()
        rollback = runner.rollback  # type: ignore[attr-defined]
        try:
            back_to, left_out = rollback(store, event_step, cfg.guard.skip_batches)
        except GuardStop:  # nothing to roll back to: the event ends the run
            guard.event(verdict)
            raise
        event = guard.event(verdict, rolled_back_to=back_to, skipped_batches=left_out)
        note = f" (back to step {back_to}, batches {left_out} left out)"
    if outputs.log is not None:
        guard.write(outputs.log.path, event)
    if outputs.progress is not None:
        outputs.progress.note(f"guard: {event.kind} at step {event.step} -> {action}{note}")
    return back_to


def _checkpoint(
    cfg: TrainConfig,
    rank: int,
    step: int,
    attempt: int,
    runner: Runner,
    store: SnapshotStore,
    progress: Progress | None,
) -> Path | None:
    """Write the checkpoint after ``step``; its directory, or None where it could not be
    written and ``--on-checkpoint-error skip`` lets the run go on without it (rank 0 warns in
    one line; every rank agrees, :meth:`SnapshotStore.save`).

    Raises:
        CheckpointWriteError: it could not be written, under ``stop``.
    """
    done = step + 1

    def written() -> None:  # where an injected failure of the checkpoint strikes
        fail_if_injected(cfg, rank, step, attempt, "checkpoint")
        fail_if_injected(cfg, rank, step, attempt, "nospace")

    try:
        return store.save(done, runner.capture(done), on_written=written)
    except CheckpointWriteError as exc:
        if cfg.checkpoint.on_checkpoint_error == "stop":
            raise CheckpointWriteError(f"{exc} (--on-checkpoint-error stop)") from exc
        if progress is not None:
            after = cfg.checkpoint.next_due(done, cfg.steps)
            then = f"trying again at step {after}" if after else "no checkpoint step is left"
            progress.note(f"warning: {exc}; skipped, {then} (--on-checkpoint-error skip)")
    return None


def common_summary(
    cfg: TrainConfig,
    log: MetricsLog,
    world: int,
    model: nn.Module,
    scaler: LossScaler | None,
) -> dict[str, Any]:
    """The summary fields every layout reports: the metrics' medians and the run's setup."""
    summary = summarize(log.records)
    summary.update(
        model=cfg.model,
        data=cfg.dataset,
        optimizer=cfg.optim.optimizer,
        peak_lr=cfg.peak_lr,
        precision=cfg.precision,
        **scaler_summary(scaler),
        world_size=world,
        parameters=sum(p.numel() for p in model.parameters()),
    )
    return summary


def write_summary(
    cfg: TrainConfig,
    summary: dict[str, Any],
    sample: Sample | None,
    board: TensorBoardLog | None,
) -> str:
    """Record the sample, write ``summary.json`` and close TensorBoard; the sample's text
    for the closing lines (empty without one)."""
    run_dir = Path(cfg.run_dir)
    shown = record_sample(sample, run_dir, summary)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if board is not None:
        board.close(summary, cfg.steps - 1)
    return shown
