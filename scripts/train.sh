#!/usr/bin/env bash
# The main job: set up the environment, then `syncline train` (extra arguments pass through).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/env.sh
exec .venv/bin/syncline train "$@"
