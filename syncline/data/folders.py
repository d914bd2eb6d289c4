"""The user's files as data sets: ``text:PATH`` as bytes, ``images:PATH`` as ImageFolder.

Builders as :mod:`syncline.data.registry` calls them, ``(seq_len, seed, path)``; the files
are listed, and checked before launch, by :mod:`syncline.data.files`.

Images are decoded once, into one uint8 tensor (a quarter of float32's memory; a batch is
converted when drawn), so drawing a batch is an indexing op as for the built-in sets. Like
``ImageFolder`` with ``ToTensor``: RGB, values in [0, 1], channels first. Every image takes
the size of the first one (sorted order), resized bilinearly where it differs; resize the
files beforehand for another size.
"""

from __future__ import annotations

from typing import Any

import torch

from syncline.data.files import (
    heldout_per_class,
    image_samples,
    read_text,
    text_files,
    tokens_argument,
)
from syncline.data.text import ByteDataset
from syncline.errors import ConfigError

__all__ = ["ImageFolderDataset", "TokenizedText", "image_folder", "text_folder", "token_folder"]


def text_folder(seq_len: int, seed: int, path: str) -> tuple[ByteDataset, int]:
    """Windows of ``seq_len`` bytes of the file, or the folder's files concatenated in
    sorted order (next-byte targets); the held-out part is the end of that stream."""
    del seed
    return ByteDataset(read_text(path), seq_len), seq_len


class TokenizedText(ByteDataset):
    """Windows of ``seq_len`` token ids (next-token targets) that can say them as text."""

    def __init__(self, ids: torch.Tensor, seq_len: int, tokenizer: Any) -> None:
        super().__init__(ids, seq_len)
        self.tokenizer = tokenizer

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids`` (what ``--sample-tokens`` prints)."""
        return str(self.tokenizer.decode(ids))

    def split(self, val_fraction: float) -> tuple[TokenizedText, TokenizedText]:
        """As :meth:`ByteDataset.split`, both parts keeping the tokenizer."""
        train, val = super().split(val_fraction)
        return (
            TokenizedText(train.data, self.block_size, self.tokenizer),
            TokenizedText(val.data, self.block_size, self.tokenizer),
        )


def token_folder(seq_len: int, seed: int, argument: str) -> tuple[TokenizedText, int]:
    """``tokens:TOKENIZER:PATH``: the files of ``PATH`` (as for ``text:``) encoded file by
    file with the ``tokenizers`` JSON ``TOKENIZER`` (UTF-8, undecodable bytes replaced), their
    ids concatenated; windows of ``seq_len`` tokens. The model's vocabulary must cover the
    tokenizer's (``syncline train`` checks a ``vocab_size`` option before launch)."""
    del seed
    tokenizer = load_tokenizer(argument)
    ids: list[int] = []
    for file in text_files(tokens_argument(argument)[1]):
        ids.extend(tokenizer.encode(file.read_bytes().decode("utf-8", "replace")).ids)
    if len(ids) <= seq_len:
        raise ConfigError(
            f"data='tokens:{argument}' holds {len(ids)} tokens; valid: more than "
            f"seq_len={seq_len} (more text, or a smaller --seq-len)"
        )
    return TokenizedText(torch.tensor(ids, dtype=torch.int32), seq_len, tokenizer), seq_len


def load_tokenizer(argument: str) -> Any:
    """The ``tokenizers`` tokenizer of ``tokens:TOKENIZER:PATH``.

    Raises:
        ConfigError: the ``tokenizers`` package is missing or cannot read the file.
    """
    path, _ = tokens_argument(argument)
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError(
            "data='tokens:...' needs the tokenizers package (pip install tokenizers)"
        ) from None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust side raises its own exception types
        raise ConfigError(
            f"data='tokens:{argument}': cannot read tokenizer {str(path)!r} ({exc}); valid: a "
            "tokenizers JSON file (e.g. a HuggingFace tokenizer.json)"
        ) from None


class ImageFolderDataset:
    """Images and their class ids, gathered a batch at a time.

    Args:
        images: uint8 ``(N, C, H, W)``.
        labels: int64 ``(N,)`` class ids.
        classes: the class names, by id.

    Example:
        >>> ds = ImageFolderDataset(torch.zeros(4, 3, 2, 2, dtype=torch.uint8),
        ...                         torch.tensor([0, 0, 1, 1]), ["cat", "dog"])
        >>> train, val = ds.split(0.5)
        >>> val.labels.tolist()
        [0, 1]
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, classes: list[str]) -> None:
        if images.dim() != 4 or len(images) != len(labels) or not len(images):
            raise ConfigError(
                f"images of shape {tuple(images.shape)} and labels of shape "
                f"{tuple(labels.shape)} do not match; valid: (N, C, H, W) and (N,), N >= 1"
            )
        self.images, self.labels, self.classes = images, labels, classes

    def __len__(self) -> int:
        return len(self.labels)

    def get(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(images in [0, 1] as float32, class ids)`` of ``indices``."""
        return self.images[indices].float().div_(255), self.labels[indices]

    def split(self, fraction: float) -> tuple[ImageFolderDataset, ImageFolderDataset]:
        """``(train, validation)``: the last ``fraction`` of each class's images held out
        (:func:`~syncline.data.files.heldout_per_class`)."""
        counts = torch.bincount(self.labels, minlength=len(self.classes)).tolist()
        held = heldout_per_class(counts, fraction)
        train, val = [], []
        for c, n_held in enumerate(held):
            mine = (self.labels == c).nonzero().flatten()
            cut = len(mine) - n_held
            train.append(mine[:cut])
            val.append(mine[cut:])
        return self._subset(torch.cat(train)), self._subset(torch.cat(val))

    def _subset(self, rows: torch.Tensor) -> ImageFolderDataset:
        return ImageFolderDataset(self.images[rows], self.labels[rows], self.classes)


def image_folder(seq_len: int, seed: int, path: str) -> tuple[ImageFolderDataset, int]:
    """Every image under ``path``'s class folders, decoded (one token per sample)."""
    del seq_len, seed
    import numpy as np
    from PIL import Image

    classes, samples = image_samples(path)
    size: tuple[int, int] | None = None
    pixels = []
    for file, _ in samples:
        with Image.open(file) as opened:
            image = opened.convert("RGB")
        size = size or image.size
        if image.size != size:
            image = image.resize(size, Image.Resampling.BILINEAR)
        pixels.append(torch.from_numpy(np.asarray(image, dtype=np.uint8).copy()))
    images = torch.stack(pixels).permute(0, 3, 1, 2).contiguous()
    labels = torch.tensor([c for _, c in samples], dtype=torch.int64)
    return ImageFolderDataset(images, labels, classes), 1
