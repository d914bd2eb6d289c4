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


def _attempt(pid: int) -> int:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    count = [e for e in environ if e.startswith(b"TORCHELASTIC_RESTART_COUNT=")]
    return int(count[0].split(b"=")[1]) if count else -1


def _restarted(launcher: int) -> bool:
    """Whether a worker of the second attempt runs."""
    try:
        return any(_attempt(pid) == 1 for pid in _workers(launcher).values())
    except OSError:  # a worker ended while it was read
        return False


@pytest.mark.slow
def test_a_stopped_rank_is_named_killed_and_the_job_restarts_promptly(tmp_path) -> None:
    run, out, timeout_s = tmp_path / "run", tmp_path / "out.txt", 10
    job = _start(
        run, out, "--steps", "60", "--checkpoint-every", "5", "--timeout", str(timeout_s),
        "--max-restarts", "1",
    )  # fmt: skip
    try:
        _until("step 12", lambda: _steps_logged(run) >= 12, 180)
        stopped = _workers(job.pid)[1]
        os.kill(stopped, signal.SIGSTOP)  # as a stuck GPU or a swapped-out host
        t0 = time.monotonic()
        _until("the restart", lambda: _restarted(job.pid), timeout_s + 60)
        began = time.monotonic() - t0
        assert job.wait(timeout=240) == 0, out.read_text()[-3000:]
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    text = out.read_text()
    named = [line for line in text.splitlines() if "did not answer" in line]
    assert named, text[-3000:]
    assert named[0].startswith("rank 0: "), named
    assert f"did not complete within {timeout_s}s" in named[0], named
    assert "; rank 1 did not answer (stopped or hung), killed: 1" in named[0], named
    assert "Traceback" not in text, text[-3000:]  # it went to the rank's log file
    assert "Traceback" in (run / "logs" / "rank0.log").read_text()
    assert not _alive(stopped)
    assert began < timeout_s + 10, began
    assert "resumed from" in text, text[-3000:]


@pytest.fixture
def small_disk(tmp_path):
    """A 1.5 MiB tmpfs: room for the run's files and two checkpoints of the tiny GPT
    (~0.5 MiB each), not for a third beside them (needs root; skipped elsewhere)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1500k", "tmpfs", str(disk)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=False)


@pytest.mark.slow
def test_a_full_disk_skips_the_checkpoint_with_one_line_and_the_run_goes_on(small_disk) -> None:
    run = small_disk / "run"
    res = syncline(
        "train", *TINY, "--run-dir", str(run), "--steps", "8", "--checkpoint-every", "2",
        "--log-every", "4", "--on-checkpoint-error", "skip", timeout=240,
    )  # fmt: skip
    text = res.stdout + res.stderr
    assert res.returncode == 0, text[-3000:]
    warned = [line for line in text.splitlines() if line.startswith("warning:")]
    assert warned, text[-3000:]
    assert warned[0].startswith(
        f"warning: checkpoint of step 6 does not fit in {run / 'checkpoints'}: "
    ), warned
    assert "No space left on device" in warned[0] and " free there; skipped" in warned[0]
    assert "Traceback" not in text, text[-3000:]
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names[:2] == ["step-00000002", "step-00000004"], names  # intact, nothing partial
