"""The data-parallel training loop behind ``syncline train`` (one call per rank).

Composition order: build the model and this rank's data shard, wrap the model in
:class:`syncline.DataParallel`, then run warm-up + cosine-decayed steps. Rank 0 alone prints,
records metrics, plots and writes the final checkpoint.
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from syncline import comm
from syncline.comm.collectives import Collective
from syncline.comm.device import Stopwatch
from syncline.data import ShardedBatches
from syncline.dp.compressors import build_compressor
from syncline.dp.engine import DataParallel
from syncline.dp.precision import LossScaler, autocast, scaler_summary
from syncline.pipeline.evaluate import evaluating
from syncline.train.checkpoint import save_checkpoint
from syncline.train.common import (
    arm_failure,
    build_datasets,
    build_model_for,
    fail_if_injected,
    loss_for,
    lr_at,
    make_optimizer,
    rank_memory,
    set_lr,
)
from syncline.train.config import TrainConfig
from syncline.train.metrics import MetricsLog, memory_summary, plot_loss, summarize, timed_record
from syncline.train.progress import Progress, human_bytes
from syncline.train.sample import Sample, record_sample, sample_for
from syncline.train.snapshots import SnapshotStore
from syncline.train.state import capture_dp, check_dp_optimizer, restore_dp
from syncline.train.tensorboard_log import TensorBoardLog
from syncline.train.validation import Validation


def train(
    cfg: TrainConfig,
    rank: int,
    world: int,
    device: torch.device,
    *,
    allreduce: str | Collective = "flat",
    attempt: int = 0,
) -> dict[str, Any]:
    """Train on this rank; returns the run summary (complete on rank 0).

    ``allreduce`` is built by the launcher-facing caller (a hierarchical collective needs
    torchrun's node layout and its own process groups). ``attempt``: torchrun's restart
    count; a restarted attempt, like ``--resume``, continues from the newest checkpoint.
    """
    model = build_model_for(cfg).to(device)
    loss_fn = loss_for(cfg)
    dataset, held_out, tokens_per_sample = build_datasets(cfg)
    batches = ShardedBatches(dataset, cfg.batch_size, rank, world, cfg.seed)
    validation = Validation(cfg, held_out, rank, world, tokens_per_sample)
    compressor = build_compressor(cfg.compression)
    dp = DataParallel(
        model,
        bucket_cap_mb=cfg.bucket_cap_mb,
        first_bucket_cap_mb=cfg.first_bucket_cap_mb,
        timeout_s=cfg.timeout_s,
        compression=compressor,
        allreduce=allreduce,
    )
    params = [p for p in dp.parameters() if p.requires_grad]
    opt = make_optimizer(cfg, params, compressor)
    scaler = LossScaler(timeout_s=cfg.timeout_s) if cfg.precision == "fp16" else None
    in_reduce = scaler is not None and not compressor.stateless
    run_dir = Path(cfg.run_dir)
    store = SnapshotStore(
        run_dir / "checkpoints", keep=cfg.keep_checkpoints, timeout_s=cfg.timeout_s, device=device
    )
    start = 0
    if cfg.resume is not None or attempt > 0:
        snap = store.latest()
        if snap is not None:
            start, exact = restore_dp(store, snap, model, opt, dp, rank, world, scaler)
            if rank == 0:
                how = "" if exact else ", resharded: fresh RNG and compressor state"
                print(f"resumed from {snap.path} (step {start}{how})", flush=True)
    log = MetricsLog(run_dir / "metrics.jsonl", resume_at=start) if rank == 0 else None
    progress = Progress(cfg.steps) if rank == 0 else None
    board = TensorBoardLog.open(run_dir, pipelined=False) if rank == 0 and cfg.tensorboard else None
    t_start = time.perf_counter()  # wall clock: the elapsed time and the ETA
    watch = Stopwatch(device)  # the step's time on its device (read at logged steps only)
    for step in range(start, cfg.steps):
        fail_if_injected(cfg, rank, step, attempt)
        armed = arm_failure(cfg, rank, step, attempt, model)
        watch.start()
        lr = lr_at(cfg, step)
        set_lr([opt], lr)
        x, y = batches.batch(step)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        if in_reduce and scaler is not None:  # the residual sees true-scale, finite values
            dp.unscale_in_reduce(scaler.value)
        with autocast(cfg.precision, device):
            loss = loss_fn(dp(x), y)
        (loss if scaler is None else scaler.scale(loss)).backward()
        # the engine's overflow flag stays on the device: the verdict is the step's one read
        flagged = dp.overflow_flag_in_reduce() if in_reduce else False
        if scaler is None or scaler.unscale_or_skip(
            params, step, unscaled=in_reduce, overflowed=flagged
        ):
            opt.step()
        for handle in armed:
            handle.remove()
        watch.stop()
        validated: dict[str, float] = {}
        if validation.due(step):  # every rank: the loss is averaged over them
            validated = validation.metrics(validation.dp_loss(model, loss_fn, device))
        if (
            log is not None
            and progress is not None
            and (step % cfg.log_every == 0 or step == cfg.steps - 1 or validated)
        ):
            value = float(loss.item())
            stats = dp.last_stats
            record = timed_record(
                step,
                value,
                lr,
                samples=cfg.batch_size,
                tokens_per_sample=tokens_per_sample,
                step_s=watch.elapsed_s(),
                run_started=t_start,
                wire_bytes=stats.wire_bytes,
                collectives=stats.collectives,
                exposed_comm_s=stats.exposed_comm_s,
                val_loss=validated.get("val_loss"),
                val_ppl=validated.get("val_ppl"),
            )
            log.append(record)
            if board is not None:
                board.add(record)
            progress.update(
                step,
                value,
                record.samples_per_s,
                record.tokens_per_s,
                stats.wire_bytes,
                step_s=record.step_s,
            )
            if validated:
                progress.validation(step, validated)
        done = step + 1
        if cfg.checkpoint_due(done):
            t_save = time.perf_counter()
            path = store.save(
                done,
                capture_dp(done, model, opt, dp, rank, world, scaler),
                on_written=functools.partial(
                    fail_if_injected, cfg, rank, step, attempt, "checkpoint"
                ),
            )
            if progress is not None:  # rank 0
                size = sum(f.stat().st_size for f in path.iterdir())
                progress.note(
                    f"checkpoint of step {done}: {human_bytes(size)} in "
                    f"{time.perf_counter() - t_save:.2f}s -> {path}"
                )
    # peak memory of each rank over the run (on its device, and resident), before rank 0
    # writes the checkpoint; the planner's memory prediction is checked against it
    mine = rank_memory(device)
    peaks = comm.gather_objects(
        mine, what="gather of peak memory", timeout_s=cfg.timeout_s, device=device
    )
    if log is None or progress is None:
        return {}
    progress.close()
    with evaluating([model]):  # rank 0 alone: its copy is the trained model
        sample = sample_for(
            cfg, model, dataset if held_out is None else held_out, tokens_per_sample, device
        )
    return _finish(cfg, model, opt, dp, log, world, peaks or [mine], scaler, board, sample)


def _finish(
    cfg: TrainConfig,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    dp: DataParallel,
    log: MetricsLog,
    world: int,
    peaks: list[dict[str, Any]],
    scaler: LossScaler | None = None,
    board: TensorBoardLog | None = None,
    sample: Sample | None = None,
) -> dict[str, Any]:
    run_dir = Path(cfg.run_dir)
    summary = summarize(log.records)
    summary.update(
        model=cfg.model,
        data=cfg.dataset,
        optimizer=cfg.optimizer,
        peak_lr=cfg.peak_lr,
        precision=cfg.precision,
        **scaler_summary(scaler),
        world_size=world,
        parameters=sum(p.numel() for p in model.parameters()),
        gradient_bytes=dp.bucket_plan.total_numel * 4,
        buckets=len(dp.bucket_plan.buckets),
        bucket_numels=[b.numel for b in dp.bucket_plan.buckets],
        bucket_tuning=dp.bucket_tuning,
        compression=cfg.compression,
        allreduce=cfg.allreduce,
        **memory_summary(peaks),
    )
    wire = summary.get("wire_bytes_per_step") or 0
    summary["compression_ratio"] = summary["gradient_bytes"] / wire if wire else None
    check_dp_optimizer(model, opt)  # refused by name, not saved unreadable
    ckpt = save_checkpoint(
        run_dir / "checkpoint.pt",
        {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "compression": dp.compression_state_dict(),
            "config": cfg.to_dict(),
            "step": cfg.steps,
        },
    )
    plot_loss(log.records, run_dir / "loss.png", f"{cfg.model} on {cfg.dataset}, {world} ranks")
    summary["checkpoint"] = str(ckpt)
    shown = record_sample(sample, run_dir, summary)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if board is not None:
        board.close(summary, cfg.steps - 1)
    print(
        f"\nsummary: {summary['steps']} steps on {world} ranks | loss "
        f"{summary['first_loss']:.4f} -> {summary['final_loss']:.4f} | "
        f"{summary['median_samples_per_s']:.1f} samples/s, "
        f"{summary['median_tokens_per_s']:.0f} tokens/s (median) | "
        f"{human_bytes(summary['wire_bytes_per_step'])} on the wire/step in "
        f"{summary['collectives_per_step']:.0f} bucket(s)"
        + (
            f" ({cfg.compression}: {summary['compression_ratio']:.1f}x less than dense)"
            if summary["compression_ratio"] and cfg.compression != "none"
            else ""
        )
        + (
            f" (measured, chosen: {dp.bucket_tuning['chosen']})"
            if dp.bucket_tuning and dp.bucket_tuning.get("candidates")
            else ""
        )
        + f" | {summary['elapsed_s']:.1f}s\n"
        f"run directory: {run_dir} (config.json, metrics.jsonl, loss.png, checkpoint.pt, "
        f"summary.json{', sample.txt' if sample else ''}"
        f"{', tensorboard/' if board else ''})" + shown,
        flush=True,
    )
    return summary
