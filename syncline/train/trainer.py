"""Data parallelism's part of ``syncline train``'s loop (:mod:`syncline.train.loop`).

Composition order: build the model and this rank's data shard, wrap the model in
:class:`syncline.DataParallel`, resume from a checkpoint if asked; each step then runs the
forward under the configured precision, the backward (whose hooks reduce the gradients) and
the optimizer. Rank 0 alone writes the final checkpoint, the plot and the summary.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from syncline import comm
from syncline.comm.collectives import Collective
from syncline.data import ShardedBatches
from syncline.dp.compressors import build_compressor
from syncline.dp.engine import DataParallel
from syncline.dp.guard import StepGuard
from syncline.dp.precision import LossScaler, autocast
from syncline.extras import installed
from syncline.optim.skip import step_unless
from syncline.pipeline.evaluate import evaluating
from syncline.train.checkpoint import save_checkpoint
from syncline.train.common import (
    build_datasets,
    build_model_for,
    loss_for,
    lr_at,
    make_optimizer,
    rank_memory,
    set_lr,
)
from syncline.train.config import TrainConfig
from syncline.train.guarding import GuardStop, batch_of, inject
from syncline.train.loop import Opening, Outputs, announce_resume, common_summary, write_summary
from syncline.train.metrics import memory_summary, plot_loss
from syncline.train.progress import human_bytes
from syncline.train.sample import sample_for
from syncline.train.snapshots import SnapshotStore
from syncline.train.state import capture_dp, check_dp_optimizer, restore_dp
from syncline.train.validation import Validation

__all__ = ["DataParallelRunner", "build_model_for", "lr_at"]


class DataParallelRunner:
    """One rank of a data-parallel run: the model wrapped in :class:`DataParallel`, its
    optimizer, the loss scaler (fp16) and this rank's shard of the data."""

    per_layer_failures = False

    def __init__(
        self,
        cfg: TrainConfig,
        rank: int,
        world: int,
        device: torch.device,
        allreduce: str | Collective,
    ) -> None:
        self.cfg, self.rank, self.world, self.device = cfg, rank, world, device
        self.model = build_model_for(cfg).to(device)
        self.loss_fn = loss_for(cfg)
        self.dataset, self.held_out, self.tokens_per_sample = build_datasets(cfg)
        self.batches = ShardedBatches(self.dataset, cfg.batch_size, rank, world, cfg.seed)
        self.validation = Validation(cfg, self.held_out, rank, world, self.tokens_per_sample)
        compressor = build_compressor(cfg.dp.compression)
        self.guard = StepGuard(cfg.guard) if cfg.guard.on else None
        #: batches of the data stream a rollback left out (the stream is the rest, in order)
        self.skipped_batches: list[int] = []
        self.dp = DataParallel(
            self.model,
            bucket_cap_mb=cfg.dp.bucket_cap_mb,
            first_bucket_cap_mb=cfg.dp.first_bucket_cap_mb,
            timeout_s=cfg.timeout_s,
            compression=compressor,
            allreduce=allreduce,
            guard=self.guard,
            sync=cfg.dp.sync,
        )
        self.params = [p for p in self.dp.parameters() if p.requires_grad]
        self.opt = make_optimizer(cfg, self.params, compressor)
        self.dp.attach(self.opt)  # sync=: counts its steps, synchronises after them
        self.scaler = LossScaler(timeout_s=cfg.timeout_s) if cfg.precision == "fp16" else None
        # an error-feedback compressor sees true-scale, finite values: unscaled in the reduce
        self.in_reduce = self.scaler is not None and not compressor.stateless
        self.start = 0

    @classmethod
    def open(cls, at: Opening) -> DataParallelRunner:
        """Build this rank's part, continued from ``at.snap`` when there is one."""
        runner = cls(at.cfg, at.rank, at.world, at.device, at.allreduce)
        store, snap, rank, world = at.store, at.snap, at.rank, at.world
        if snap is not None:
            runner.start, exact = restore_dp(
                store, snap, runner.model, runner.opt, runner.dp, rank, world, runner.scaler
            )
            announce_resume(rank, snap, runner.start, exact)
        return runner

    def step(self, step: int, lr: float) -> torch.Tensor:
        cfg, dp, scaler = self.cfg, self.dp, self.scaler
        set_lr([self.opt], lr)
        batch = batch_of(step, self.skipped_batches)
        x, y = self.batches.batch(batch)
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        self.opt.zero_grad(set_to_none=True)
        if self.in_reduce and scaler is not None:
            dp.unscale_in_reduce(scaler.value)
        with autocast(cfg.precision, self.device):
            loss = self.loss_fn(dp(x), y)
        if self.guard is not None:
            loss, hooks = inject(cfg.guard, self.rank, batch, self.model, loss)
            self.guard.watch_loss(loss)
            loss.backward()
            for hook in hooks:
                hook.remove()
            step_unless(self.opt, self.guard.skip_flag)  # dropped on the device, no host read
            return loss.detach()
        (loss if scaler is None else scaler.scale(loss)).backward()
        # the engine's overflow flag stays on the device: the verdict is the step's one read
        flagged = dp.overflow_flag_in_reduce() if self.in_reduce else False
        if scaler is None or scaler.unscale_or_skip(
            self.params, step, unscaled=self.in_reduce, overflowed=flagged
        ):
            self.opt.step()
        return loss.detach()

    def rollback(self, store: SnapshotStore, step: int, skip: int) -> tuple[int, list[int]]:
        """Restore the newest checkpoint and leave out ``skip`` batches of the data stream
        from the one step ``step`` trained on; the step to continue from, and the batches
        left out."""
        snap = store.latest()
        if snap is None:
            raise GuardStop(
                f"rollback at step {step}: no checkpoint to roll back to yet (the first is "
                "written after checkpoint_every steps); stopped"
            )
        start, _ = restore_dp(
            store, snap, self.model, self.opt, self.dp, self.rank, self.world, self.scaler
        )
        first = batch_of(step, self.skipped_batches)
        left_out = [b for b in range(first, first + skip) if b not in self.skipped_batches]
        self.skipped_batches = sorted(self.skipped_batches + left_out)
        assert self.guard is not None
        self.guard.clear_latch()
        return start, left_out

    def validation_loss(self) -> float:
        return self.validation.dp_loss(self.model, self.loss_fn, self.device)

    def record_fields(self, step: int, *, final: bool) -> dict[str, Any]:
        if self.rank != 0:  # rank 0 records; the others need not read the statistics
            return {}
        stats = self.dp.last_stats
        # a step whose backward averaged nothing (sync=, between synchronisations) sent only
        # what its synchronisation did
        sync = self.dp.sync
        wire = (stats.wire_bytes if sync.last_reduced else 0) + sync.last_wire_bytes
        return {
            "wire_bytes": wire,
            "collectives": stats.collectives,
            "exposed_comm_s": stats.exposed_comm_s,
            "progress_wire": wire,
        }

    def capture(self, done: int) -> dict[str, torch.Tensor]:
        return capture_dp(done, self.model, self.opt, self.dp, self.rank, self.world, self.scaler)

    def finish(self, outputs: Outputs) -> dict[str, Any]:
        cfg = self.cfg
        # peak memory of each rank over the run (on its device, and resident), before rank 0
        # writes the checkpoint; the planner's memory prediction is checked against it
        mine = rank_memory(self.device)
        peaks = comm.gather_objects(
            mine, what="gather of peak memory", timeout_s=cfg.timeout_s, device=self.device
        )
        log, progress = outputs.log, outputs.progress
        if log is None or progress is None:
            return {}
        progress.close()
        with evaluating([self.model]):  # rank 0 alone: its copy is the trained model
            data = self.dataset if self.held_out is None else self.held_out
            sample = sample_for(cfg, self.model, data, self.tokens_per_sample, self.device)
        dp = self.dp
        summary = common_summary(cfg, log, self.world, self.model, self.scaler)
        summary.update(
            gradient_bytes=dp.bucket_plan.total_numel * 4,
            buckets=len(dp.bucket_plan.buckets),
            bucket_numels=[b.numel for b in dp.bucket_plan.buckets],
            bucket_tuning=dp.bucket_tuning,
            compression=cfg.dp.compression,
            allreduce=cfg.dp.allreduce,
            **memory_summary(peaks or [mine]),
        )
        wire = summary.get("wire_bytes_per_step") or 0
        summary["compression_ratio"] = summary["gradient_bytes"] / wire if wire else None
        check_dp_optimizer(self.model, self.opt)  # refused by name, not saved unreadable
        run_dir = Path(cfg.run_dir)
        ckpt = save_checkpoint(
            run_dir / "checkpoint.pt",
            {
                "model": self.model.state_dict(),
                "optimizer": self.opt.state_dict(),
                "compression": dp.compression_state_dict(),
                "sync": dp.sync.state_dict(),
                "config": cfg.to_dict(),
                "step": cfg.steps,
            },
        )
        title = f"{cfg.model} on {cfg.dataset}, {self.world} ranks"
        plot_loss(log.records, run_dir / "loss.png", title)
        summary["checkpoint"] = str(ckpt)
        shown = write_summary(cfg, summary, sample, outputs.board)
        _print_summary(cfg, summary, dp, self.world, sample is not None, outputs.board is not None)
        if shown:
            print(shown.lstrip("\n"), flush=True)
        return summary


def _print_summary(
    cfg: TrainConfig,
    summary: dict[str, Any],
    dp: DataParallel,
    world: int,
    sample: bool,
    board: bool,
) -> None:
    ratio = summary["compression_ratio"]
    print(
        f"\nsummary: {summary['steps']} steps on {world} ranks | loss "
        f"{summary['first_loss']:.4f} -> {summary['final_loss']:.4f} | "
        f"{summary['median_samples_per_s']:.1f} samples/s, "
        f"{summary['median_tokens_per_s']:.0f} tokens/s (median) | "
        f"{human_bytes(summary['wire_bytes_per_step'])} on the wire/step in "
        f"{summary['collectives_per_step']:.0f} bucket(s)"
        + (
            f" ({cfg.dp.compression}: {ratio:.1f}x less than dense)"
            if ratio and cfg.dp.compression != "none"
            else ""
        )
        + (
            f" (measured, chosen: {dp.bucket_tuning['chosen']})"
            if dp.bucket_tuning and dp.bucket_tuning.get("candidates")
            else ""
        )
        + f" | {summary['elapsed_s']:.1f}s\n"
        f"run directory: {cfg.run_dir} (config.json, metrics.jsonl, "
        f"{'loss.png, ' if installed('matplotlib') else ''}checkpoint.pt, "
        f"summary.json{', sample.txt' if sample else ''}"
        f"{', tensorboard/' if board else ''})",
        flush=True,
    )
