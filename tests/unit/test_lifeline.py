"""The pieces of fault handling on their own: the run directory's lock, a worker that dies
with its parent, and the liveness round over heartbeats in a store (no torchrun)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from syncline.errors import ConfigError
from syncline.launch.lifeline import LOCK_NAME, lock_run_dir


def test_a_locked_run_dir_is_refused_naming_its_holder_and_freed_on_release(tmp_path) -> None:
    run = tmp_path / "run"
    with lock_run_dir(run) as lock:
        lock.announce()
        holder = (run / LOCK_NAME).read_text().strip()
        assert holder.startswith(f"pid {os.getpid()} on host ")
        # a second holder (flock is per open file, so also in this process)
        with pytest.raises(ConfigError) as refused, lock_run_dir(run):
            pass
        assert str(refused.value) == (
            f"run directory {run} is in use by another job ({holder}); wait for it to end or "
            "stop it, or choose another --run-dir"
        )
    with lock_run_dir(run):  # released with its holder
        pass


def test_taking_the_lock_writes_nothing_into_the_run_dir(tmp_path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    with lock_run_dir(run):
        assert list(run.iterdir()) == []


def test_a_worker_dies_with_its_parent(tmp_path) -> None:
    """The parent starts a child that arms :func:`die_with_parent`, prints its pid and
    sleeps; the parent then exits without a word: the child is gone within seconds."""
    child = textwrap.dedent(
        """
        import sys, time
        from syncline.launch.lifeline import die_with_parent
        die_with_parent()
        print("armed", flush=True)
        time.sleep(60)
        """
    )
    parent = textwrap.dedent(
        f"""
        import os, subprocess, sys
        p = subprocess.Popen([sys.executable, "-c", {child!r}], stdout=subprocess.PIPE,
                             start_new_session=True)
        assert p.stdout.readline().strip() == b"armed"
        print(p.pid, flush=True)
        os._exit(0)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", parent], capture_output=True, text=True, timeout=60, check=True
    )
    pid = int(out.stdout.strip())
    deadline = time.monotonic() + 5
    while _alive(pid):
        assert time.monotonic() < deadline, "the child outlived its parent"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def test_the_liveness_round_names_the_ranks_whose_heartbeat_stopped() -> None:
    import datetime

    import torch.distributed as dist

    from syncline.comm.liveness import Heartbeat, describe_silent

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10))
    beats = [
        Heartbeat.connect("127.0.0.1", server.port, r, 3, "/test/", timeout_s=10) for r in range(3)
    ]
    for beat in beats:
        beat.interval_s = 0.1
    beats[0].start()
    beats[1].start()  # rank 2 never beats: stopped before its first
    try:
        assert beats[0].silent(wait_s=0.6) == [2]
        assert describe_silent(beats[0], wait_s=0.6) == "; rank 2 did not answer (stopped or hung)"
        beats[1].stop()  # now rank 1 is silent too
        assert describe_silent(beats[0], wait_s=0.6) == (
            "; ranks 1, 2 did not answer (stopped or hung)"
        )
        # who/2 was never published: nothing to kill; rank 1 is this very process: spared
        assert beats[0].stop_local([1, 2]) == []
    finally:
        for beat in beats:
            beat.stop()
    assert describe_silent(None) == ""
