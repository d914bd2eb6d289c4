#!/usr/bin/env bash
# Check syncline on this machine's GPU in one command (under 8 minutes): 1-rank NCCL training
# with checkpoint and resume, DataParallel vs DDP bit for bit, compressors against the CPU,
# single-stage pipelines, steps/s, peak memory and host syncs; writes
# benchmarks/results/gpu_check.json and exits non-zero if any check fails.
# `--device cpu` runs the same checks on the CPU with gloo (CI); `--help` lists the options.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/env.sh
# each check has its own limit inside; this one only guards the runner itself
exec timeout --kill-after=10 600 .venv/bin/python -m benchmarks.gpu_check "$@"
