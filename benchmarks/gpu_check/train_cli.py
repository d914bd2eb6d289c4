"""Check 1: ``syncline train`` on one rank (NCCL on CUDA), with a periodic checkpoint, then
``--resume`` of the run, then its ``checkpoint.pt`` read in a fresh process that sees no GPU.

This is the path a GPU user takes first; every barrier, checkpoint and resume of a one-rank
run goes through it, and a checkpoint written on a GPU must load on a CPU-only host.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.gpu_check.common import Record, backend_for, run_bounded, tail

STEPS, RESUMED_STEPS, EVERY = 6, 9, 3
TRAIN_TIMEOUT_S = 55.0  # each of the two launches (the check has 150 s)
READ_TIMEOUT_S = 30.0
# fp16: loss scaling and its overflow verdict run too. The CPU takes it as well (autocast has
# fp16 kernels there and TrainConfig accepts every precision on every device), so the CPU run
# checks the same path.
PRECISION = "fp16"
TINY = [
    "--nproc-per-node", "1", "--n-layer", "1", "--n-embd", "32", "--n-head", "2",
    "--seq-len", "16", "--batch-size", "8", "--log-every", "2", "--eval-every", "0",
    "--val-fraction", "0", "--sample-tokens", "0", "--warmup-steps", "1",
]  # fmt: skip

# In a fresh interpreter with CUDA_VISIBLE_DEVICES="": the file's payload (after syncline's
# header) through torch.load(map_location="cpu"), and the library's own reader, which a
# CPU-only host uses on resume or in evaluation.
READ_BACK = """
import io, json, sys, torch
from syncline.train.checkpoint import MAGIC, load_checkpoint
path = sys.argv[1]
data = open(path, "rb").read()
payload = io.BytesIO(data[len(MAGIC) + 32:])  # after the magic and the SHA-256 digest
state = torch.load(payload, map_location="cpu", weights_only=True)
tensors = [v for v in state["model"].values() if isinstance(v, torch.Tensor)]
out = {"keys": sorted(state), "model_tensors": len(tensors),
       "devices": sorted({str(t.device) for t in tensors}),
       "finite": all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point()),
       "cuda_visible": torch.cuda.is_available()}
try:
    load_checkpoint(path)
    out["load_checkpoint"] = "ok"
except Exception as exc:
    out["load_checkpoint"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


def _syncline(args: list[str]) -> tuple[dict[str, Any], str]:
    """Run ``syncline ARGS`` bounded; (its outcome, its stdout)."""
    done = run_bounded([sys.executable, "-m", "syncline.cli.main", *args], TRAIN_TIMEOUT_S)
    outcome: dict[str, Any] = {"returncode": done.returncode}
    if done.timed_out:
        outcome["error"] = f"timed out after {TRAIN_TIMEOUT_S:.0f}s"
    if done.returncode != 0:
        outcome["output_tail"] = tail(done.stdout + "\n" + done.stderr)
    return outcome, done.stdout


def _summary(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "summary.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _read_back(path: Path) -> dict[str, Any]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = run_bounded([sys.executable, "-c", READ_BACK, str(path)], READ_TIMEOUT_S, env)
    if done.returncode != 0:
        return {"error": tail(done.stdout + "\n" + done.stderr)}
    read: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return read


def check_train(device: str) -> Record:
    """1-rank ``syncline train`` with periodic checkpoints, ``--resume``, and the final
    ``checkpoint.pt`` read back on the CPU (see the module docstring)."""
    run_dir = Path(tempfile.mkdtemp(prefix="gpu-check-train-"))
    backend, precision = backend_for(device), PRECISION
    try:
        first, _ = _syncline(
            ["train", *TINY, "--backend", backend, "--precision", precision,
             "--steps", str(STEPS), "--checkpoint-every", str(EVERY), "--run-dir", str(run_dir)]
        )  # fmt: skip
        periodic = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*"))
        after_first = _summary(run_dir).get("steps")
        resumed, out = _syncline(["train", "--resume", str(run_dir), "--steps", str(RESUMED_STEPS)])
        summary = _summary(run_dir)
        checkpoint = run_dir / "checkpoint.pt"
        read = _read_back(checkpoint) if checkpoint.is_file() else {"error": "no checkpoint.pt"}
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    final_loss = summary.get("final_loss")
    checks = {
        "first_run_exit_0": first["returncode"] == 0,
        "periodic_checkpoints_written": len(periodic) >= 1,
        "first_run_steps": after_first == STEPS,
        "resume_exit_0": resumed["returncode"] == 0,
        "resumed_from_checkpoint": "resumed from" in out,
        "resumed_run_steps": summary.get("steps") == RESUMED_STEPS,
        "final_loss_finite": isinstance(final_loss, float) and math.isfinite(final_loss),
        "read_back_on_cpu": read.get("devices") == ["cpu"] and bool(read.get("finite")),
        "load_checkpoint_on_cpu_host": read.get("load_checkpoint") == "ok",
    }
    return {
        "ok": all(checks.values()),
        "backend": backend,
        "precision": precision,
        "steps": STEPS,
        "checkpoint_every": EVERY,
        "resumed_to": RESUMED_STEPS,
        "checks": checks,
        "periodic_checkpoints": periodic,
        "first_run": first,
        "resume": resumed,
        "final_loss": final_loss,
        "loss_scale": summary.get("loss_scale"),
        "skipped_steps": summary.get("skipped_steps"),
        "read_back": read,
    }
