#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install syncline into it.
# pyproject.toml asks for torch>=2.13 as a library does; this environment pins what CI tests
# (constraints.txt: torch==2.13.0, whose CPU wheel pip takes where one lies on disk).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.syncline-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints.txt -nt "$stamp" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip >/dev/null
  .venv/bin/python -m pip install --quiet -e ".[dev]" -c constraints.txt 2>&1 | grep -v "is ignored: it is neither" || true
  .venv/bin/python -c "import torch, syncline; assert torch.__version__.startswith('2.13.0'), torch.__version__"
  touch "$stamp"
fi
