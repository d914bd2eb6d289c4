"""Checkpoints that are written atomically and verified on load.

Format: an 8-byte magic, the 32-byte SHA-256 of the payload, then the ``torch.save`` payload.
The file is written to a temporary name in the same directory, fsync'ed, then renamed over
the target, so a crash leaves either the old checkpoint or the new one, never half of one; a
flipped or truncated byte is caught by the digest before ``torch.load`` sees it.

The digest stops corruption, not an attacker (who writes a matching digest), so the payload is
read with ``torch.load(weights_only=True)``: only tensors and plain containers of numbers and
strings are rebuilt, and a payload that would import or call anything else is refused with a
:class:`~syncline.errors.CheckpointError` before any of its code runs.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import tempfile
from pathlib import Path
from typing import Any

import torch

from syncline.errors import CheckpointError

MAGIC = b"SYNCLN01"
_DIGEST = 32


def save_checkpoint(path: str | os.PathLike[str], state: dict[str, Any]) -> Path:
    """Write ``state`` atomically to ``path``; returns the path."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getvalue()
    digest = hashlib.sha256(payload).digest()
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + digest)
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        dir_fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def load_checkpoint(
    path: str | os.PathLike[str], map_location: str | torch.device = "cpu"
) -> dict[str, Any]:
    """Read and verify a checkpoint written by :func:`save_checkpoint`, its tensors on
    ``map_location`` (default the CPU: a checkpoint of a GPU run is read on a CPU-only host,
    and nothing lands on a GPU the reader did not choose).

    Raises:
        CheckpointError: when the file is missing, not a syncline checkpoint, truncated,
            corrupted (digest mismatch), or holds anything but tensors and plain data (a
            payload that would run code on load).
    """
    source = Path(path)
    if not source.is_file():
        raise CheckpointError(f"checkpoint {source} does not exist")
    data = source.read_bytes()
    head = len(MAGIC) + _DIGEST
    if len(data) < head or not data.startswith(MAGIC):
        raise CheckpointError(f"{source} is not a syncline checkpoint (bad header)")
    payload = data[head:]
    if hashlib.sha256(payload).digest() != data[len(MAGIC) : head]:
        raise CheckpointError(
            f"{source} is corrupted or truncated: SHA-256 of its {len(payload)} payload bytes "
            "does not match the recorded digest"
        )
    try:
        state = torch.load(io.BytesIO(payload), map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"{source} holds objects a checkpoint may not (only tensors, numbers, strings and "
            f"their lists and dicts are loaded; nothing in it was run): {first}"
        ) from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{source} holds {type(state).__name__}, expected a dict")
    return state
