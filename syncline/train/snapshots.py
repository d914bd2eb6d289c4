"""Periodic sharded checkpoints of a run: written by every rank at once, published atomically,
verified and read safely.

Layout, under ``RUN_DIR/checkpoints``::

    step-00000100/          a complete checkpoint: DCP's files, and MANIFEST.json (the size
                            and SHA-256 of every file, written last)
    .partial-step-00000200/ one being written (never read; removed by the next save)

A checkpoint becomes visible in one ``rename`` of its directory, after every rank's files and
the manifest are on disk (fsync'ed), so a reader never sees half of one, whatever step a
failure hits. The newest ``keep`` are kept. Loading verifies every file against the manifest
(each rank a share of the files) before any byte is used, and reads the DCP metadata and any
plain data without unpickling code (:mod:`syncline.comm.sharded`).

The run directory must be one file system that every rank sees (as for DCP itself).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from syncline import comm
from syncline.comm.sharded import load_sharded, save_sharded
from syncline.errors import CheckpointError, CheckpointWriteError
from syncline.fields import check_int

__all__ = ["Snapshot", "SnapshotStore", "problems"]

_NAME = re.compile(r"^step-(\d{8})$")
MANIFEST = "MANIFEST.json"


@dataclass(frozen=True)
class Snapshot:
    """One complete checkpoint: the step it was taken after, and its directory."""

    step: int
    path: Path


class SnapshotStore:
    """The checkpoints of one run (see the module docstring).

    Args:
        root: the directory holding them (``RUN_DIR/checkpoints``).
        keep: how many of the newest to keep (at least 1).
        group: the process group that saves and loads together.
        timeout_s: the limit of every wait on other ranks.
        device: where the small exchanges between ranks (digests, verdicts) travel: the
            device of the run's tensors (NCCL exchanges GPU tensors).
    """

    def __init__(
        self,
        root: Path,
        *,
        keep: int,
        group: comm.Group = None,
        timeout_s: float = 300.0,
        device: torch.device | None = None,
    ) -> None:
        check_int("keep_checkpoints", keep)
        self.root = Path(root)
        self.keep = keep
        self.group = group
        self.timeout_s = timeout_s
        self.device = device
        self._verified: set[Path] = set()  # checked once; a resume reads a snapshot twice

    # -- reading ---------------------------------------------------------------------------
    def complete(self) -> list[Snapshot]:
        """Every published checkpoint, oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for d in self.root.iterdir():
            m = _NAME.match(d.name)
            if m and d.is_dir() and (d / MANIFEST).is_file():
                found.append(Snapshot(int(m.group(1)), d))
        return sorted(found, key=lambda s: s.step)

    def latest(self) -> Snapshot | None:
        """The newest published checkpoint, or ``None``."""
        done = self.complete()
        return done[-1] if done else None

    def newest_intact(self, note: Callable[[str], None] | None = None) -> Snapshot | None:
        """The newest checkpoint that verifies (every rank calls this; each checks a share of
        the files), or ``None`` when there is none at all. A damaged one is skipped for the
        one before it, and ``note`` (rank 0's printer) gets one line naming it and why.

        Raises:
            CheckpointError: checkpoints exist but none verifies (naming each one's damage).
        """
        skipped = []
        for snap in reversed(self.complete()):
            problem = self.verify(snap)
            if problem is None:
                return snap
            skipped.append(problem)
            if note is not None:
                note(f"skipping checkpoint {snap.path}: {problem}; trying the one before it")
        if skipped:
            raise CheckpointError(f"no intact checkpoint under {self.root}: {'; '.join(skipped)}")
        return None

    def verify(self, snap: Snapshot) -> str | None:
        """What is wrong with ``snap`` (the first damaged or missing file), or ``None``;
        every rank checks a share of its files and every rank gets the verdict."""
        if snap.path in self._verified:
            return None
        rank, world = comm.group_rank(self.group), comm.group_size(self.group)
        everyone = self._everyone(problems(snap.path, rank, world), f"verification of {snap.path}")
        found = [p for rank_problems in everyone for p in rank_problems]
        if found:
            return f"damaged: {found[0]}"
        self._verified.add(snap.path)
        return None

    def load(self, snap: Snapshot, keys: list[str]) -> dict[str, torch.Tensor]:
        """Verify ``snap`` (every rank a share of its files) and read ``keys`` on this rank.

        Raises:
            CheckpointError: on every rank, naming the first damaged or missing file.
        """
        problem = self.verify(snap)
        if problem is not None:
            raise CheckpointError(f"checkpoint {snap.path} is {problem}")
        return load_sharded(snap.path, keys, group=self.group, timeout_s=self.timeout_s)

    # -- writing ---------------------------------------------------------------------------
    def save(
        self,
        step: int,
        tensors: dict[str, torch.Tensor],
        on_written: Callable[[], None] | None = None,
    ) -> Path:
        """Write ``tensors`` (each rank its own; shared keys once) as the checkpoint of
        ``step``, publish it, and drop the oldest beyond ``keep``. Every rank calls this.

        ``on_written`` runs once this rank's files are on disk, before publication (where
        ``--inject-failure R:S:checkpoint`` strikes).

        Raises:
            CheckpointWriteError: on every rank alike, when any rank could not write (a full
                disk: naming the directory and its free space); nothing of this step is
                published and the checkpoints before it are untouched.
        """
        final = self.root / f"step-{step:08d}"
        self._verified.discard(final)  # rewritten below: checked again if read
        partial = self.root / f".partial-step-{step:08d}"
        rank, world = comm.group_rank(self.group), comm.group_size(self.group)
        failure = None
        if rank == 0:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(partial, ignore_errors=True)
                partial.mkdir()
            except OSError as exc:
                failure = _failure(exc)
        self._agree(step, partial, [failure], f"checkpoint {step}: directory ready")
        mine: dict[str, tuple[int, str]] = {}
        try:
            save_sharded(tensors, partial, group=self.group, timeout_s=self.timeout_s)
            if on_written is not None:
                on_written()
            names = sorted(p.name for p in partial.iterdir())
            mine = {n: _size_and_digest(partial / n) for n in names[rank::world]}
        except (CheckpointWriteError, OSError) as exc:
            failure = _failure(exc)
        everyone = self._everyone((mine, failure), f"checkpoint {step} digests")
        self._agree(step, partial, [f for _, f in everyone], None)
        if rank == 0:
            files = {
                n: {"size": s, "sha256": d} for part, _ in everyone for n, (s, d) in part.items()
            }
            try:
                manifest = json.dumps({"step": step, "files": files}, indent=1)
                _write_synced(partial / MANIFEST, manifest)
                _fsync_dir(partial)
                if final.exists():  # the same step again (a restarted run): the new copy wins
                    shutil.rmtree(final)
                os.replace(partial, final)
                _fsync_dir(self.root)
                self._prune()
            except OSError as exc:
                failure = _failure(exc)
        self._agree(step, partial, [failure], f"checkpoint {step}: published")
        return final

    def _agree(
        self,
        step: int,
        partial: Path,
        failures: list[tuple[str, bool] | None],
        what: str | None,
    ) -> None:
        """Raise the same :class:`CheckpointWriteError` on every rank if any rank failed.

        ``failures``: every rank's (already exchanged, ``what`` None) or this rank's alone,
        exchanged here (under ``what``); rank 0's is every rank's verdict when only rank 0
        acted."""
        if what is not None:
            failures = [f for [f] in self._everyone(failures, what)]
        found = [f for f in failures if f is not None]
        if not found:
            return
        if comm.group_rank(self.group) == 0:
            shutil.rmtree(partial, ignore_errors=True)
        detail, _ = next((f for f in found if f[1]), found[0])
        if any(no_space for _, no_space in found):
            free = _free_bytes(self.root)
            raise CheckpointWriteError(
                f"checkpoint of step {step} does not fit in {self.root}: {detail}; "
                f"{_human(free)} free there",
                no_space=True,
            )
        raise CheckpointWriteError(f"checkpoint of step {step} could not be written: {detail}")

    def _prune(self) -> None:
        for snap in self.complete()[: -self.keep]:
            shutil.rmtree(snap.path, ignore_errors=True)
        for d in self.root.iterdir():
            if d.name.startswith(".partial-step-"):
                shutil.rmtree(d, ignore_errors=True)

    def _everyone(self, mine: Any, what: str) -> list[Any]:
        """Every rank's ``mine``, on every rank."""
        return comm.allgather_objects(
            mine, group=self.group, what=what, timeout_s=self.timeout_s, device=self.device
        )


def problems(path: Path, rank: int = 0, world: int = 1) -> list[str]:
    """What is wrong with the checkpoint in ``path``: the manifest, the list of files, and
    the sizes and digests of share ``rank`` of ``world`` of the files (by default all: a
    single process, such as the command line before a launch)."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [f"{MANIFEST} unreadable ({exc})"]
    listed = sorted(files)
    on_disk = sorted(p.name for p in path.iterdir() if p.name != MANIFEST)
    if listed != on_disk:
        return [f"files {sorted(set(listed) ^ set(on_disk))} differ from {MANIFEST}"]
    found = []
    for name in listed[rank::world]:
        try:
            size, digest = _size_and_digest(path / name)
        except OSError as exc:
            found.append(f"{name} unreadable ({exc})")
            continue
        want = files[name]
        if [size, digest] != [want.get("size"), want.get("sha256")]:
            found.append(f"{name} ({size} bytes) does not match its recorded digest")
    return found


def _failure(exc: BaseException) -> tuple[str, bool]:
    """A write failure as (one line, whether a file system was full)."""
    no_space = getattr(exc, "no_space", False) or (
        isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)
    )
    text = str(exc).strip()
    return (" ".join(text.splitlines()[0].split()) if text else type(exc).__name__), no_space


def _free_bytes(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _human(n: int | None) -> str:
    if n is None:
        return "unknown space"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def _size_and_digest(path: Path) -> tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
