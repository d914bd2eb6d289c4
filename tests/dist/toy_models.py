"""Small models that exercise the awkward cases: frozen, tied, unused and BatchNorm."""

from __future__ import annotations

import torch
from torch import nn


class Frozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 3)
        self.a.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class Tied(nn.Module):
    """Embedding and output projection share one weight, used twice in the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.mid = nn.Linear(8, 8)
        self.out = nn.Linear(8, 11, bias=True)
        self.out.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.mid(self.emb(x)))).mean(dim=1)


class Unused(nn.Module):
    """``never`` is never used; ``odd`` only on odd steps (so sometimes no rank uses it)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.odd = nn.Linear(8, 8)
        self.never = nn.Linear(8, 8)
        self.b = nn.Linear(8, 3)
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if self.step % 2 == 1:
            h = h + self.odd(h)
        return self.b(h)


class WithBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 4, 3, padding=1),
            nn.BatchNorm2d(4),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(4 * 5 * 5, 3),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


MODELS = {"frozen": Frozen, "tied": Tied, "unused": Unused, "bn": WithBN}


def make(name: str) -> nn.Module:
    torch.manual_seed(1234)
    return MODELS[name]()


def batch(name: str, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic global batch for ``step``; ranks slice their shard from it."""
    g = torch.Generator().manual_seed(10_000 + step)
    y = torch.randint(0, 3, (size,), generator=g)
    if name == "tied":
        x = torch.randint(0, 11, (size, 5), generator=g)
        y = torch.randint(0, 11, (size,), generator=g)
    elif name == "bn":
        x = torch.randn(size, 1, 5, 5, generator=g)
    else:
        x = torch.randn(size, 6, generator=g)
    return x, y
