"""PURE (no torch): a worker dies with its agent, and a run directory has one live job.

torchrun starts every worker in a session of its own, so a signal to the launcher's process
group (a scheduler's cancel, Ctrl-C of a wrapper script, a lost agent) does not reach the
workers: they would train on and write into the run directory while a new job starts there.
:func:`die_with_parent` makes the kernel SIGKILL the worker when its parent goes
(``PR_SET_PDEATHSIG``), with a thread that watches the parent as a fallback (other kernels,
or a parent that went before the worker could ask). :func:`lock_run_dir` lets one job at a
time use a run directory (``flock`` on the directory: released by the kernel when its holder
dies, however).
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

from syncline.errors import ConfigError

__all__ = ["AGENT_PID_VARIABLE", "LOCK_NAME", "RunLock", "die_with_parent", "lock_run_dir"]

#: the environment variable through which :func:`syncline.launch.torchrun.launch` tells its
#: workers the agent's pid (the parent they must not outlive)
AGENT_PID_VARIABLE = "SYNCLINE_AGENT_PID"
#: the file in a run directory that names the job holding it (pid, host, start time)
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


class RunLock:
    """The lock a job holds on its run directory (see :func:`lock_run_dir`)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir

    def announce(self) -> Path:
        """Write who holds the lock (pid, host, start time) into ``RUN_DIR/.syncline.lock``,
        where a refused job reads it; called once the job is going to run (a refused or
        invalid command leaves the directory as it was)."""
        path = self.run_dir / LOCK_NAME
        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        path.write_text(f"pid {os.getpid()} on host {socket.gethostname()}, started {started}\n")
        return path


@contextlib.contextmanager
def lock_run_dir(run_dir: str | os.PathLike[str]) -> Iterator[RunLock]:
    """Hold the run directory ``run_dir`` (created if missing) for the block.

    The lock is an ``flock`` on the directory itself; the kernel drops it when its holder
    exits, also by SIGKILL, so a crashed job never leaves a stale lock behind. (``flock``
    needs a file system that supports it across the hosts that share the run directory; on
    one host every local file system does.) Taking it writes nothing: the holder names
    itself with :meth:`RunLock.announce`.

    Raises:
        ConfigError: another live job holds the lock, naming it (from its announcement).
    """
    path = Path(run_dir)
    path.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = (path / LOCK_NAME).read_text().strip()
            except OSError:
                holder = ""
            raise ConfigError(
                f"run directory {run_dir} is in use by another job "
                f"({holder or 'one that has not named itself yet'}); wait for it to end or "
                f"stop it, or choose another --run-dir"
            ) from None
        yield RunLock(path)
    finally:
        os.close(fd)  # releases the lock
