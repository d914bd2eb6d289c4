#!/usr/bin/env bash
# Check syncline on this machine's GPU in one command (under 8 minutes): 1-rank NCCL training
# with checkpoint and resume, DataParallel vs DDP bit for bit, compressors against the CPU,
# single-stage pipelines, steps/s, peak memory and host syncs; writes
# benchmarks/results/gpu_check.json and exits non-zero if any check fails.
# `--device cpu` runs the same checks on the CPU with gloo (CI); `--help` lists the options.
set -euo pipefail
cd "$(dirname "$0")/.."
# Which Python: SYNCLINE_PYTHON if set; else, on a GPU machine, a python3 whose torch sees the
# GPU (a GPU image brings its own CUDA build of torch and may have no network to install
# another: syncline then runs from this checkout beside it); else the project's .venv.
case " $* " in *" --device cpu "*|*" --device=cpu "*) want_cpu=1 ;; *) want_cpu=0 ;; esac
if [ -n "${SYNCLINE_PYTHON:-}" ]; then
  PY=$SYNCLINE_PYTHON
elif [ "$want_cpu" = 0 ] && python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  PY=python3
else
  bash scripts/env.sh
  PY=.venv/bin/python
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
echo "gpu_check: $("$PY" -c 'import sys, torch; print(sys.executable, "torch", torch.__version__)')"
# each check has its own limit inside; this one only guards the runner itself
exec timeout --kill-after=10 600 "$PY" -m benchmarks.gpu_check "$@"
