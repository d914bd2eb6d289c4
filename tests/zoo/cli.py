"""Running the ``syncline`` command line (``python -m syncline.cli.main``) as a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys


def syncline(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """``syncline ARGS...`` in a fresh interpreter, unbuffered; stdout and stderr captured."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "syncline.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
