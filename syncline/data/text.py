"""Byte-level text: a corpus read from the Python standard library, and next-byte pairs."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import torch

from syncline.errors import ConfigError
from syncline.fields import check_int

__all__ = ["ByteDataset", "stdlib_corpus", "stdlib_files"]

# Third-party packages and byte code are not the standard library's source.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
# The regression test suites: large, and full of deliberately odd code.
_TEST_DIRS = frozenset({"test", "tests", "idle_test"})


def stdlib_files(include_tests: bool = False) -> list[Path]:
    """The standard library's ``.py`` files, in the order ``stdlib_corpus`` reads them.

    The walk starts at ``sysconfig.get_paths()["stdlib"]`` and is top-down with directory
    and file names sorted, so the order depends only on the installed files. It skips
    ``site-packages``, ``dist-packages`` and ``__pycache__``, the generated
    ``_sysconfigdata*`` module (it records the build machine), and unless
    ``include_tests`` the test directories (``test``, ``tests``, ``idle_test``).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = _SKIP_DIRS if include_tests else _SKIP_DIRS | _TEST_DIRS
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        files.extend(
            Path(dirpath, name)
            for name in sorted(filenames)
            if name.endswith(".py") and not name.startswith("_sysconfigdata")
        )
    return files


def stdlib_corpus(max_bytes: int = 4_000_000, include_tests: bool = False) -> bytes:
    """The standard library's Python source, concatenated: a text corpus with no download.

    Files from ``stdlib_files`` are read in order and joined as they are (no separator)
    until ``max_bytes`` are collected; the result is cut to exactly ``max_bytes`` unless
    the whole library is shorter. The same Python installation always gives the same bytes.

    Args:
        max_bytes: length cap, >= 1. The default is about a third of CPython 3.11's library.
        include_tests: also read the test directories.

    Returns:
        The corpus as bytes.

    Raises:
        ConfigError: if ``max_bytes`` is not a positive int.
        FileNotFoundError: if no source files are found (a zipped or stripped stdlib).

    Example:
        >>> len(stdlib_corpus(1000))
        1000
    """
    check_int("max_bytes", max_bytes)
    chunks: list[bytes] = []
    total = 0
    for path in stdlib_files(include_tests):
        if total >= max_bytes:
            break
        chunk = path.read_bytes()
        chunks.append(chunk)
        total += len(chunk)
    if total == 0:
        root = sysconfig.get_paths()["stdlib"]
        raise FileNotFoundError(f"no .py source files found under the stdlib path {root}")
    return b"".join(chunks)[:max_bytes]


def _bytes_to_tensor(data: bytes | bytearray) -> torch.Tensor:
    """A uint8 tensor holding its own copy of ``data``."""
    if not data:  # torch.frombuffer rejects an empty buffer
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class ByteDataset:
    """All windows of ``block_size + 1`` consecutive tokens, as next-token pairs.

    Sample ``i`` is ``x = data[i : i + block_size]`` and ``y = data[i + 1 : i + block_size + 1]``,
    both LongTensors, so ``len(self) == len(data) - block_size``.

    Args:
        data: bytes, or a 1-D integer tensor of token ids.
        block_size: length of each sample, >= 1.

    Raises:
        ConfigError: if ``block_size`` is not positive, ``data`` is not 1-D integers, or
            ``data`` is not longer than ``block_size``.

    Example:
        >>> ds = ByteDataset(b"hello world", block_size=4)
        >>> x, y = ds.get(torch.tensor([0]))
        >>> bytes(x[0].tolist()), bytes(y[0].tolist())
        (b'hell', b'ello')
    """

    def __init__(self, data: bytes | bytearray | torch.Tensor, block_size: int) -> None:
        check_int("block_size", block_size)
        if isinstance(data, bytes | bytearray):
            tokens = _bytes_to_tensor(data)
        elif isinstance(data, torch.Tensor):
            if data.dim() != 1 or data.is_floating_point() or data.is_complex():
                raise ConfigError(
                    f"data tensor of shape {tuple(data.shape)} and dtype {data.dtype} is "
                    f"invalid; valid: a 1-D integer tensor"
                )
            tokens = data
        else:
            raise ConfigError(
                f"data of type {type(data).__name__} is invalid; valid: bytes or a 1-D tensor"
            )
        if len(tokens) <= block_size:
            raise ConfigError(
                f"data has {len(tokens)} tokens for block_size={block_size}; "
                f"valid: at least {block_size + 1}"
            )
        self.data = tokens
        self.block_size = block_size
        self._window = torch.arange(block_size + 1)

    def __len__(self) -> int:
        return len(self.data) - self.block_size

    def get(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather samples ``indices`` as ``(x, y)``, each LongTensor (len(indices), block_size)."""
        windows = self.data[indices.reshape(-1, 1) + self._window].long()
        return windows[:, :-1], windows[:, 1:]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} samples")
        x, y = self.get(torch.tensor([index % len(self)]))
        return x[0], y[0]

    def split(self, val_fraction: float) -> tuple[ByteDataset, ByteDataset]:
        """Cut the token stream in two: the first part for training, the last for validation.

        The cut is of the underlying data, not of the samples, so no window crosses it.

        Args:
            val_fraction: share of the tokens that go to validation, in (0, 1).

        Returns:
            ``(train, val)`` with the same ``block_size``.

        Raises:
            ConfigError: if the fraction is outside (0, 1) or leaves a part with no more
                than ``block_size`` tokens.
        """
        if not isinstance(val_fraction, int | float) or not 0.0 < val_fraction < 1.0:
            raise ConfigError(f"val_fraction={val_fraction!r} is invalid; valid: 0 < f < 1")
        n = len(self.data)
        n_val = round(n * val_fraction)
        smallest = min(n - n_val, n_val)
        if smallest <= self.block_size:
            raise ConfigError(
                f"val_fraction={val_fraction} splits {n} tokens into {n - n_val} + {n_val}; "
                f"valid: both parts more than block_size={self.block_size} tokens"
            )
        return (
            ByteDataset(self.data[: n - n_val], self.block_size),
            ByteDataset(self.data[n - n_val :], self.block_size),
        )
