"""What the tests of syncline inside other frameworks (Lightning, Accelerate) share: the
environment torchrun would give a worker, a small regression net and each rank's data."""

from __future__ import annotations

import os

import torch
from torch import nn

BATCH = 8


def torchrun_env(rank: int, world: int) -> None:
    """The variables a framework reads to find its place in a torchrun job (the process
    group itself is up already)."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        NODE_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",  # unused: the group is up already
        OMP_NUM_THREADS="1",
    )


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )


def data(rank: int, batches: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's own samples: ``batches`` batches of ``BATCH`` with a learnable target."""
    x = torch.randn(batches * BATCH, 8, generator=torch.Generator().manual_seed(rank))
    return x, x[:, :4] - x[:, 4:]
