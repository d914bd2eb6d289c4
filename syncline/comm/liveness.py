"""Who is still there: each rank's heartbeat in the job's key-value store, read after a timeout.

A collective that times out names the rank that waited, not the one it waited for. Each rank
therefore bumps a counter in the store torchrun's ranks rendezvous through, from a daemon
thread, every ``interval_s``; a rank that times out runs a short liveness round
(:meth:`Heartbeat.silent`: whose counter did not move in a few seconds) and says who did not
answer. A thread keeps beating while its rank waits in a collective or computes, so a silent
counter means a stopped, hung or dead process, not a slow one. Ranks of this host that did
not answer are then killed (SIGKILL, which a stopped process cannot ignore), so that torchrun
restarts the job at once instead of waiting out its grace period for them.

The heartbeat uses a store connection of its own (a second client of the job's store), so it
never shares one with the process groups' own use of the store.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import socket
import threading
import time
from pathlib import Path

import torch.distributed as dist

__all__ = ["Heartbeat", "describe_silent"]


class Heartbeat:
    """This rank's heartbeat, and the liveness round over every rank's.

    Args:
        store: a store every rank of the job shares (its own namespace: see :meth:`connect`).
        rank, world: this rank and the number of ranks.
        interval_s: how often the counter moves.
    """

    def __init__(self, store: dist.Store, rank: int, world: int, *, interval_s: float = 0.5):
        self.store = store
        self.rank = rank
        self.world = world
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def connect(
        cls, host: str, port: int, rank: int, world: int, namespace: str, *, timeout_s: float = 30
    ) -> Heartbeat:
        """A heartbeat over a new client connection to the store at ``host:port`` (under
        torchrun: ``MASTER_ADDR``/``MASTER_PORT``), in ``namespace`` (one per attempt)."""
        client = dist.TCPStore(
            host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s)
        )
        return cls(dist.PrefixStore(namespace, client), rank, world)

    def start(self) -> None:
        """Publish where this rank runs (host and pid) and start beating."""
        self.store.set(f"who/{self.rank}", f"{socket.gethostname()} {os.getpid()}")
        self._thread = threading.Thread(target=self._beat, name="syncline-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval_s + 1)

    def _beat(self) -> None:
        key = f"beat/{self.rank}"
        while not self._stop.is_set():
            try:
                self.store.add(key, 1)
            except Exception:  # the store went away (its host ended): nothing to report to
                return
            self._stop.wait(self.interval_s)

    def silent(self, wait_s: float = 3.0) -> list[int]:
        """The ranks whose heartbeat did not move in ``wait_s`` seconds (this one excluded).

        Raises:
            RuntimeError: the store cannot be read.
        """
        others = [r for r in range(self.world) if r != self.rank]
        before = {r: self.store.add(f"beat/{r}", 0) for r in others}
        time.sleep(wait_s)
        return [r for r in others if self.store.add(f"beat/{r}", 0) == before[r]]

    def stop_local(self, ranks: list[int]) -> list[int]:
        """SIGKILL those of ``ranks`` that run on this host (a stopped or hung worker ignores
        SIGTERM); returns the ranks killed. Only a live process whose command line is a
        syncline worker's is touched, so a recycled pid is left alone."""
        host, killed = socket.gethostname(), []
        for r in ranks:
            try:  # a rank stopped before it said who it is has nothing to kill: ask first,
                # since a get of a missing key blocks for the store's whole timeout
                if not self.store.check([f"who/{r}"]):
                    continue
                where = self.store.get(f"who/{r}").decode()
            except Exception:
                continue
            their_host, _, pid = where.partition(" ")
            if their_host != host or not pid.isdigit() or int(pid) == os.getpid():
                continue
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"syncline" in cmdline:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
                    killed.append(r)
        return killed


def describe_silent(heartbeat: Heartbeat | None, wait_s: float = 3.0) -> str:
    """The liveness round's verdict as the tail of a timeout's message, e.g. ``"; rank 1 did
    not answer (stopped or hung)"``; the silent ranks of this host are killed. Empty when
    there is no heartbeat or the store cannot be read."""
    if heartbeat is None:
        return ""
    try:
        silent = heartbeat.silent(wait_s)
        killed = heartbeat.stop_local(silent)
    except Exception:  # the store's host may be what failed: the timeout alone is the news
        return ""
    if not silent:
        return "; every other rank answered the liveness check (they wait elsewhere)"
    who = ", ".join(str(r) for r in silent)
    text = f"; {'rank' if len(silent) == 1 else 'ranks'} {who} did not answer (stopped or hung)"
    if killed:
        text += f", killed: {', '.join(str(r) for r in killed)}"
    return text
