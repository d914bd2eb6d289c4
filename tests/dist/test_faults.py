"""Faults a long run meets, with real processes: a launcher killed with its process group, a
second job on a live run directory, a stopped rank.

``syncline train`` runs as a user starts it (torchrun, tiny GPT); the test plays the
scheduler: it kills the launcher's process group or stops a worker with SIGSTOP, and
checks what every process does within a bound. The bounds are hang detectors on a loaded
2-core machine, not speed claims.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.zoo.cli import syncline

TINY = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--seq-len", "16"]
TINY += ["--batch-size", "8", "--log-every", "1", "--sample-tokens", "0"]


def _start(run: Path, out: Path, *extra: str) -> subprocess.Popen[bytes]:
    """``syncline train`` in a session of its own (the test kills its process group),
    everything it prints into ``out``."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "syncline.cli.main", "train", *TINY, "--run-dir", str(run)]
    with open(out, "wb") as sink:
        return subprocess.Popen(
            [*cmd, *extra], stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )


def _until(what: str, check: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"waited {timeout_s}s for {what}"
        time.sleep(0.1)


def _steps_logged(run: Path) -> int:
    path = run / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its reaper does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


def _workers(launcher: int) -> dict[int, int]:
    """The launcher's workers: rank -> pid (from their environment)."""
    found = {}
    for task in Path(f"/proc/{launcher}/task").iterdir():
        for pid in (task / "children").read_text().split():
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            rank = [e for e in environ if e.startswith(b"RANK=")]
            if b"syncline.train.worker" in cmdline and rank:
                found[int(rank[0].split(b"=")[1])] = int(pid)
    return found


@pytest.mark.slow
def test_workers_die_with_their_launcher_and_a_live_run_dir_is_locked(tmp_path) -> None:
    run, out = tmp_path / "run", tmp_path / "first.txt"
    first = _start(run, out, "--steps", "5000", "--checkpoint-every", "50")
    try:
        _until("the first steps", lambda: _steps_logged(run) >= 2, 120)
        workers = _workers(first.pid)
        assert sorted(workers) == [0, 1], workers

        # a second job on the same run directory is refused, naming the live one
        second = syncline("train", *TINY, "--steps", "4", "--run-dir", str(run), timeout=120)
        assert second.returncode == 2, second.stdout + second.stderr
        line = second.stderr.strip()
        assert len(line.splitlines()) == 1, line
        assert f"run directory {run} is in use by another job (pid {first.pid} on host" in line
        assert re.search(r"started \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", line), line
        assert _steps_logged(run) >= 2  # the refused job touched nothing

        os.killpg(first.pid, signal.SIGKILL)  # the launcher's group; the workers' sessions live
        first.wait(timeout=30)
        t0 = time.monotonic()
        _until("the workers to end", lambda: not any(map(_alive, workers.values())), 10)
        assert time.monotonic() - t0 < 10
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    # the lock went with its holder: the run directory is free again
    again = syncline("train", *TINY, "--steps", "2", "--run-dir", str(run), timeout=240)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
