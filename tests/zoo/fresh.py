"""Running a snippet in a fresh interpreter: what importing a module loads, or does, at once."""

from __future__ import annotations

import subprocess
import sys


def run_python(code: str, timeout: float = 60) -> None:
    """Runs ``python -c CODE``; raises ``CalledProcessError`` if it fails (an assert in it)."""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=timeout)
