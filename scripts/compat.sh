#!/usr/bin/env bash
# Run the fast test tier against another torch than the dev environment's pinned one:
#   bash scripts/compat.sh                 # the newest torch pip can install here
#   bash scripts/compat.sh 2.14.1          # a given release
#   bash scripts/compat.sh 2.14.1 tests/unit   # any further arguments go to pytest
# A throwaway virtual environment (COMPAT_VENV, default .venv-compat) gets that torch first,
# then syncline with its test tools *without* constraints.txt, as a user's `pip install`
# would; it is removed afterwards unless KEEP_VENV=1. A torch build with CUDA is several GB.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
venv=${COMPAT_VENV:-.venv-compat}
want=${1:-}
[ $# -gt 0 ] && shift
spec=torch
[ -n "$want" ] && spec="torch==$want"
cleanup() { [ "${KEEP_VENV:-0}" = 1 ] || rm -rf "$venv"; }
trap cleanup EXIT
trap "exit 143" TERM INT  # a killed run (timeout) still removes its environment
rm -rf "$venv"
"$PY" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip >/dev/null
"$venv/bin/python" -m pip install --quiet "$spec" 2>&1 | grep -v "is ignored: it is neither" || true
"$venv/bin/python" -m pip install --quiet -e ".[dev]" 2>&1 | grep -v "is ignored: it is neither" || true
version=$("$venv/bin/python" -c "import torch; print(torch.__version__)")
if [ -n "$want" ] && [ "${version%%+*}" != "$want" ]; then
  echo "compat: asked for torch $want, the environment holds $version" >&2
  exit 1
fi
echo "== compat: torch $version, fast tier"
"$venv/bin/python" -m pytest -m "not slow" "$@"
echo "== compat: torch $version passed"
