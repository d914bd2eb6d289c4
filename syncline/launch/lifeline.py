"""PURE (no torch): a worker dies with its agent, and a run directory has one live job.

torchrun starts every worker in a session of its own, so a signal to the launcher's process
group (a scheduler's cancel, Ctrl-C of a wrapper script, a lost agent) does not reach the
workers: they would train on and write into the run directory while a new job starts there.
:func:`die_with_parent` makes the kernel SIGKILL the worker when its parent goes
(``PR_SET_PDEATHSIG``), with a thread that watches the parent as a fallback (other kernels,
or a parent that went before the worker could ask). :func:`lock_run_dir` lets one job at a
time use a run directory (``flock``: released by the kernel when its holder dies, however).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from syncline.errors import ConfigError

__all__ = ["AGENT_PID_VARIABLE", "LOCK_NAME", "die_with_parent", "lock_run_dir"]

#: the environment variable through which :func:`syncline.launch.torchrun.launch` tells its
#: workers the agent's pid (the parent they must not outlive)
AGENT_PID_VARIABLE = "SYNCLINE_AGENT_PID"
#: the lock file in a run directory; it names its holder (pid, host, start time)
LOCK_NAME = ".syncline.lock"
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int | None = None, *, poll_s: float = 0.5) -> None:
    """End this process by SIGKILL as soon as its parent ``parent`` (default: the current
    one) exits.

    Linux: the kernel's parent-death signal, armed here; every platform: a daemon thread
    that checks ``os.getppid()`` every ``poll_s`` seconds. If the parent is already gone
    (the worker was re-parented before it got here), the process ends at once.
    """
    expected = os.getppid() if parent is None else parent
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != expected:
        os.kill(os.getpid(), signal.SIGKILL)

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != expected:
                os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="syncline-parent-watch", daemon=True).start()


@contextlib.contextmanager
def lock_run_dir(run_dir: str | os.PathLike[str]) -> Iterator[Path]:
    """Hold ``RUN_DIR/.syncline.lock`` for the duration of the block; yields its path.

    The lock is an ``flock`` on the file, which records the holder's pid, host and start
    time. The kernel drops it when the holder exits, also by SIGKILL, so a crashed job never
    leaves a stale lock behind. (``flock`` needs a file system that supports it across the
    hosts that share the run directory; on one host every local file system does.)

    Raises:
        ConfigError: another live job holds the lock, naming it.
    """
    path = Path(run_dir) / LOCK_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    handle: IO[str] = open(path, "a+")  # noqa: SIM115  (held open for the whole block)
    try:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "a job that has not written its name yet"
            raise ConfigError(
                f"run directory {run_dir} is in use by another job ({holder}); wait for it "
                f"to end or stop it, or choose another --run-dir (lock: {path})"
            ) from None
        handle.seek(0)
        handle.truncate()
        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        handle.write(f"pid {os.getpid()} on host {socket.gethostname()}, started {started}\n")
        handle.flush()
        yield path
    finally:
        handle.close()  # releases the lock
