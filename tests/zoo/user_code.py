"""A user's own code and files, written into a folder: what ``--model``/``--data`` point at.

The unit tests (bad input, builders) and the multi-process runs use the same module and
folders, so both exercise what a user would write.
"""

from __future__ import annotations

import random
from pathlib import Path

#: the factory module a test writes (``--model user_models:TinyLM``)
MODULE = "user_models"

MODELS_SOURCE = '''
"""A user's models and data sets, outside syncline."""

import torch
import torch.nn.functional as F
from torch import nn


class TinyLM(nn.Module):
    """A byte-level model that is no nn.Sequential (split points cut it)."""

    def __init__(self, seq_len: int, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.pos = nn.Parameter(torch.zeros(seq_len, width))
        self.body = nn.Sequential(nn.Linear(width, width), nn.Tanh())
        self.head = nn.Linear(width, 256)

    def forward(self, ids):
        return self.head(self.body(self.embed(ids) + self.pos[: ids.shape[1]]))


class ConvNet(nn.Module):
    def __init__(self, classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.body = nn.Sequential(nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, classes))

    def forward(self, pixels):
        return self.body(self.stem(pixels))


OFFSET = 10.0  # the user's loss is cross-entropy + 10: its values show it was used


def offset_loss(logits, target):
    return F.cross_entropy(logits, target) + OFFSET


def conv_net(classes: int = 3):
    """A factory returning (model, loss)."""
    return ConvNet(classes), offset_loss


def not_a_model():
    return 42


def pairs(seq_len: int, seed: int):
    """A map-style data set: 40 (input, class) pairs."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, generator=g), i % 2) for i in range(40)]


def not_pairs():
    return [1, 2, 3]
'''


def write_module(folder: Path) -> Path:
    """``folder/user_models.py`` (see ``MODELS_SOURCE``)."""
    path = folder / f"{MODULE}.py"
    path.write_text(MODELS_SOURCE)
    return path


def write_text_folder(folder: Path, files: int = 3, words: int = 700) -> Path:
    """A folder of text files (one in a sub-folder, one hidden and skipped)."""
    rng = random.Random(0)
    vocab = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "trains"]
    (folder / "part").mkdir(parents=True, exist_ok=True)
    for i in range(files):
        where = folder / "part" if i == files - 1 else folder
        (where / f"{i}.txt").write_text(" ".join(rng.choice(vocab) for _ in range(words)) + "\n")
    (folder / ".hidden.txt").write_bytes(b"\0 never read")
    return folder


def write_image_folder(folder: Path, per_class: int = 8) -> Path:
    """Three classes of tiny coloured PNGs (8x8; the first image 6x10, so the rest are
    resized to it), and a stray non-image file that is ignored, as ImageFolder does."""
    from PIL import Image

    rng = random.Random(0)
    colours = {"blue": (30, 40, 220), "green": (30, 200, 40), "red": (220, 30, 30)}
    for name, rgb in colours.items():
        where = folder / name
        where.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            jitter = tuple(max(0, min(255, c + rng.randint(-40, 40))) for c in rgb)
            Image.new("RGB", (6, 10) if i == 0 else (8, 8), jitter).save(where / f"{i}.png")
    (folder / "blue" / "notes.txt").write_text("not an image")
    return folder
