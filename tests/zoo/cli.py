"""Running the ``syncline`` command line (``python -m syncline.cli.main``) as a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys


def syncline(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """``syncline ARGS...`` in a fresh interpreter, unbuffered; stdout and stderr captured.

    A ``train`` run skips the generated sample unless the test asks for one
    (``--sample-tokens``): 200 tokens cost a pipeline 200 forward passes through its stages,
    seconds per run over dozens of runs; ``tests/dist/test_run_outputs.py`` tests it.
    """
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if args[:1] == ("train",) and "--sample-tokens" not in args:
        args = (*args, "--sample-tokens", "0")
    return subprocess.run(
        [sys.executable, "-m", "syncline.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
