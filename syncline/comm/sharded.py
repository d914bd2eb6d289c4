"""Sharded checkpoint I/O over the process group, through ``torch.distributed.checkpoint``.

Every rank writes its own tensors in parallel; a tensor several ranks hold under the same key
(a data-parallel replica's weights) is written once, by one of them (DCP's planner). Reading
gives every rank the keys it asks for, whoever wrote them, so a checkpoint can be read back by
a different number of ranks.

Reading is safe against a hostile file. DCP itself unpickles its ``.metadata`` file with
``pickle.load`` and any non-tensor entry with ``torch.load(weights_only=False)``: a checkpoint
from anyone would run code. Here the metadata is rebuilt by an unpickler that knows only DCP's
own metadata classes, dtypes and paths, every file it names must be a plain name inside the
checkpoint directory, and non-tensor entries are never written or read (callers store plain
data as tensors, see :func:`pack_object`).
"""

from __future__ import annotations

import errno
import io
import pickle
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from syncline.comm.groups import Group, comm_error, global_rank
from syncline.errors import CheckpointError, CheckpointWriteError

__all__ = ["load_sharded", "pack_object", "read_index", "save_sharded", "unpack_object"]

_DCP_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Rebuilds DCP metadata and nothing else: any other global is refused, unimported."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_CLASSES or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refused global {module}.{name}")


class _SafeReader(dcp.FileSystemReader):
    """DCP's file reader with :class:`_MetadataUnpickler` and file names checked."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return read_metadata(Path(str(self.path)))


def read_metadata(directory: Path) -> Metadata:
    """The checkpoint's DCP metadata, read safely (see the module docstring).

    Raises:
        CheckpointError: the file is missing, holds anything but DCP metadata, or names a
            data file outside ``directory``.
    """
    path = directory / ".metadata"
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(f"{directory} is not a checkpoint (no .metadata)") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as exc:
        raise CheckpointError(
            f"{path} is not DCP metadata or holds objects a checkpoint may not ({exc}); "
            "nothing in it was run"
        ) from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path} holds {type(metadata).__name__}, not DCP metadata")
    for info in (metadata.storage_data or {}).values():
        name = str(getattr(info, "relative_path", ""))
        if not name or Path(name).name != name or name in (".", ".."):
            raise CheckpointError(f"{path} names a data file outside the checkpoint: {name!r}")
    if metadata.storage_meta is not None:
        metadata.storage_meta.load_id = None
    return metadata


def read_index(directory: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor the checkpoint holds: its key, shape and dtype (read safely)."""
    out = {}
    for key, meta in read_metadata(directory).state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata):
            raise CheckpointError(
                f"{directory}: entry {key!r} is not a tensor; syncline checkpoints hold only "
                "tensors (a non-tensor entry would be unpickled on load)"
            )
        out[key] = (tuple(meta.size), meta.properties.dtype)
    return out


def save_sharded(
    tensors: Mapping[str, torch.Tensor],
    directory: Path,
    *,
    group: Group,
    timeout_s: float | None = None,
) -> None:
    """Write ``tensors`` into ``directory`` together with every rank of ``group``.

    Every rank calls this, each with its own keys; a key that several ranks pass must hold
    the same values on all of them (it is written once). Only tensors: plain data goes in
    through :func:`pack_object`. Files are fsync'ed before this returns on any rank.

    Raises:
        CheckpointWriteError: a rank could not write its files (DCP tells every rank), with
            ``no_space`` when a file system was full.
        CommError: a peer stopped or failed in DCP's own exchanges (CommTimeout: past
            ``timeout_s``).
    """
    for key, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"save_sharded: {key!r} is {type(value).__name__}, not a tensor")
    try:
        dcp.save(
            dict(tensors),
            storage_writer=dcp.FileSystemWriter(str(directory), sync_files=True),
            process_group=group,
        )
    except CheckpointException as exc:
        raise write_error(exc, directory) from None
    except OSError as exc:
        raise CheckpointWriteError(
            f"writing {directory} failed: {exc}", no_space=_no_space(exc)
        ) from exc
    except RuntimeError as exc:  # DCP's collectives: a peer that stopped or died
        raise comm_error(global_rank(), f"writing {directory}", exc, timeout_s) from exc


def _no_space(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def write_error(exc: CheckpointException, directory: Path) -> CheckpointWriteError:
    """DCP's report of the ranks that failed to write, as one line: the first rank's error
    (``no_space`` if any rank's file system was full)."""
    causes = []
    for rank, failure in sorted(exc.failures.items()):
        cause = failure[0] if isinstance(failure, tuple) else failure
        causes.append((rank, cause))
    no_space = any(_no_space(c) for _, c in causes)
    if causes:
        rank, cause = next(((r, c) for r, c in causes if _no_space(c)), causes[0])
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
        what = f"rank {rank}: {type(cause).__name__}: {first}"
    else:
        what = str(exc).strip().splitlines()[0] if str(exc).strip() else "unknown"
    return CheckpointWriteError(f"writing {directory} failed ({what})", no_space=no_space)


def load_sharded(
    directory: Path, keys: Iterable[str], *, group: Group, timeout_s: float | None = None
) -> dict[str, torch.Tensor]:
    """Read ``keys`` (each rank its own) from a checkpoint written by :func:`save_sharded`.

    Raises:
        CheckpointError: a key the checkpoint does not hold (naming it), or unsafe metadata.
    """
    index = read_index(directory)
    wanted = list(keys)
    missing = [k for k in wanted if k not in index]
    if missing:
        raise CheckpointError(
            f"{directory} lacks {len(missing)} entr{'y' if len(missing) == 1 else 'ies'} "
            f"this run needs: {missing[:5]}"
        )
    # host tensors DCP reads the files into (its own collectives exchange only plans); the
    # caller moves what it needs to its device
    cpu = torch.device("cpu")
    out = {k: torch.empty(index[k][0], dtype=index[k][1], device=cpu) for k in wanted}
    try:
        dcp.load(out, storage_reader=_SafeReader(str(directory)), process_group=group)
    except RuntimeError as exc:  # DCP's collectives: a peer that stopped or died
        raise comm_error(global_rank(), f"reading {directory}", exc, timeout_s) from exc
    return out


def pack_object(obj: Any) -> torch.Tensor:
    """Plain data (numbers, strings, tensors in lists and dicts) as a byte tensor."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def unpack_object(blob: torch.Tensor, what: str) -> Any:
    """The inverse of :func:`pack_object`, with ``weights_only=True``: code never runs.
    Tensors inside come back on the CPU (``map_location``), so a checkpoint written on a GPU
    reads on a host without one."""
    try:
        data = blob.detach().cpu().numpy().tobytes()
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"{what} holds objects a checkpoint may not; nothing in it was run: {first}"
        ) from None
