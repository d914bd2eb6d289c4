#!/usr/bin/env bash
# Set up the environment, then lint (ruff), type-check (mypy) and run the test suite (pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/env.sh
echo "== ruff check"; .venv/bin/ruff check syncline tests benchmarks examples
echo "== ruff format --check"; .venv/bin/ruff format --check syncline tests benchmarks examples
echo "== mypy"; .venv/bin/mypy
echo "== pytest"; .venv/bin/python -m pytest "$@"
