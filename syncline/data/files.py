"""PURE: the files behind ``--data text:PATH``, ``tokens:TOKENIZER:PATH``, ``images:PATH``.

Listing is deterministic (sorted names, hidden entries skipped), so every rank, and a resumed
run, reads the same samples in the same order. The checks run in the command's process
before any rank starts and need no torch: a bad path, an empty folder, a file that cannot be
read or is not what it should be stops the command with one line naming it.
"""

from __future__ import annotations

import os
from pathlib import Path

from syncline.errors import ConfigError

__all__ = [
    "IMAGE_EXTENSIONS",
    "check_images",
    "check_text",
    "check_tokens",
    "heldout_per_class",
    "image_samples",
    "read_text",
    "text_files",
    "tokens_argument",
]

#: torchvision's ``ImageFolder`` extensions; other files in a class folder are ignored, as
#: there
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
_SNIFF = 8192  # bytes read to tell text from binary, as git does (a NUL byte: binary)


def _visible(name: str) -> bool:
    return not name.startswith(".")


def _walk(root: Path) -> list[Path]:
    """Regular files under ``root``, hidden ones and hidden folders skipped, in sorted order
    of their paths (top-down, names sorted)."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if _visible(d))
        found += [Path(dirpath, n) for n in sorted(filenames) if _visible(n)]
    return [p for p in found if p.is_file()]


def text_files(path: str) -> list[Path]:
    """``path`` itself when it is a file, else every file under the folder ``path``.

    Raises:
        ConfigError: ``path`` does not exist, or the folder holds no file.
    """
    where = Path(path)
    if where.is_file():
        return [where]
    if not where.is_dir():
        raise ConfigError(
            f"data='text:{path}': no such file or folder; valid: text:PATH of a text file or "
            "a folder of text files"
        )
    files = _walk(where)
    if not files:
        raise ConfigError(
            f"data='text:{path}': the folder holds no file; valid: a folder of text files "
            "(hidden ones are skipped)"
        )
    return files


def read_text(path: str) -> bytes:
    """The bytes of :func:`text_files`, concatenated in order: what ``text:PATH`` trains on."""
    return b"".join(p.read_bytes() for p in text_files(path))


def check_text(path: str, seq_len: int, val_fraction: float) -> None:
    """``text:PATH`` names readable text (no NUL byte in each file's first 8 KiB), long
    enough for ``seq_len``-byte samples on both sides of the held-out split.

    Raises:
        ConfigError: naming the path or the file, and what is valid.
    """
    total = 0
    for file in text_files(path):
        try:
            with file.open("rb") as f:
                head = f.read(_SNIFF)
            total += file.stat().st_size
        except OSError as exc:
            raise ConfigError(
                f"data='text:{path}': cannot read {file} ({exc.strerror or exc}); valid: "
                "readable text files"
            ) from None
        if b"\0" in head:
            raise ConfigError(
                f"data='text:{path}': {file} is not text (it holds NUL bytes); valid: text "
                "files only (move other files out of the folder)"
            )
    held = round(total * val_fraction)
    parts = [total - held, held] if val_fraction else [total]
    if min(parts) <= seq_len:
        split = f", split {total - held} + {held} by val_fraction={val_fraction}" if held else ""
        raise ConfigError(
            f"data='text:{path}' holds {total} bytes{split}; valid: more than "
            f"seq_len={seq_len} bytes in each part (more text, or a smaller --seq-len)"
        )


def image_samples(path: str) -> tuple[list[str], list[tuple[Path, int]]]:
    """``(classes, samples)`` of a folder of class sub-folders, as ``ImageFolder`` has
    them: classes are the sub-folders' names in sorted order, a sample is an image file in
    one (at any depth) with its class's index, in sorted order.

    Raises:
        ConfigError: no such folder, no class sub-folder, or a class with no image.
    """
    where = Path(path)
    if not where.is_dir():
        raise ConfigError(
            f"data='images:{path}': no such folder; valid: images:PATH of a folder with one "
            "sub-folder of images per class"
        )
    classes = sorted(d.name for d in where.iterdir() if d.is_dir() and _visible(d.name))
    if not classes:
        raise ConfigError(
            f"data='images:{path}' has no class sub-folders; valid: PATH/CLASS/IMAGE files, "
            "one sub-folder per class"
        )
    samples: list[tuple[Path, int]] = []
    for index, name in enumerate(classes):
        mine = [p for p in _walk(where / name) if p.suffix.lower() in IMAGE_EXTENSIONS]
        if not mine:
            raise ConfigError(
                f"data='images:{path}': class folder {name!r} holds no image; valid: files "
                f"ending in {', '.join(IMAGE_EXTENSIONS)}"
            )
        samples += [(p, index) for p in mine]
    return classes, samples


def heldout_per_class(counts: list[int], fraction: float) -> list[int]:
    """Images held out for validation of each class: the last ``round(n * fraction)`` of
    its ``n`` (stratified, so that the held-out set has every class, not only the last).

    Raises:
        ConfigError: the split leaves no image on one side.
    """
    held = [round(n * fraction) if fraction else 0 for n in counts]
    total = sum(counts)
    if fraction and not 0 < sum(held) < total:
        raise ConfigError(
            f"val_fraction={fraction} of {total} images holds out {sum(held)}; valid: a "
            "fraction (or more images) leaving at least one image on each side"
        )
    return held


def check_images(path: str, seq_len: int, val_fraction: float) -> None:
    """``images:PATH`` is a folder of class folders of images that Pillow can open.

    Raises:
        ConfigError: naming the path or the file, and what is valid.
    """
    del seq_len
    from PIL import Image, UnidentifiedImageError  # lazy: only images need Pillow

    classes, samples = image_samples(path)
    for file, _ in samples:
        try:
            with Image.open(file):  # reads and identifies the header: the check
                pass
        except (OSError, UnidentifiedImageError) as exc:
            raise ConfigError(
                f"data='images:{path}': cannot read {file} as an image ({exc}); valid: "
                f"image files Pillow reads ({', '.join(IMAGE_EXTENSIONS)})"
            ) from None
    heldout_per_class([sum(1 for _, c in samples if c == i) for i in range(len(classes))],
                      val_fraction)  # fmt: skip


def tokens_argument(argument: str) -> tuple[Path, str]:
    """``TOKENIZER:PATH`` of ``--data tokens:TOKENIZER:PATH``: the tokenizer's file (a
    ``tokenizers`` JSON, e.g. a HuggingFace ``tokenizer.json``) and the text's path.

    Raises:
        ConfigError: no ``:`` between them, or the tokenizer file does not exist.
    """
    tokenizer, sep, path = argument.partition(":")
    if not sep or not tokenizer or not path:
        raise ConfigError(
            f"data='tokens:{argument}': valid: tokens:TOKENIZER:PATH, a tokenizer.json file "
            "and a text file or folder"
        )
    if not Path(tokenizer).is_file():
        raise ConfigError(
            f"data='tokens:{argument}': tokenizer {tokenizer!r} is not a file; valid: a "
            "tokenizers JSON file (e.g. a HuggingFace tokenizer.json)"
        )
    return Path(tokenizer), path


def check_tokens(argument: str, seq_len: int, val_fraction: float) -> None:
    """``tokens:TOKENIZER:PATH``: the tokenizer file exists and ``PATH`` passes
    :func:`check_text` (the token count, smaller, is checked when the text is tokenized)."""
    _, path = tokens_argument(argument)
    check_text(path, seq_len, val_fraction)
