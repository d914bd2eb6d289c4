"""A small ResNet-like image classifier, built as a flat nn.Sequential of blocks.

``ConvBlock -> ResidualBlock * (depth - 1) -> AdaptiveAvgPool2d -> Flatten -> Linear``; the
pool keeps a coarse grid (up to 4x4) rather than one value per channel, so the classifier
still sees where features are.
Its BatchNorm layers carry running statistics in buffers, which is what makes it the
reference model for testing buffer handling in data and pipeline parallelism.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from syncline.models.configs import CNNConfig
from syncline.models.meta_init import reset_parameters

__all__ = ["CNNConfig", "ConvBlock", "ResidualBlock", "build_cnn", "cnn_layer_init", "cnn_loss"]

_POOLED_GRID = 4  # side of the feature grid the classifier sees, at most


class ConvBlock(nn.Module):
    """3x3 convolution (same padding), BatchNorm2d, ReLU: (N, C_in, H, W) -> (N, C_out, H, W)."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


class ResidualBlock(nn.Module):
    """relu(x + bn(conv(x))): a ConvBlock with an identity shortcut (He et al. 2016)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn(self.conv(x)))


def build_cnn(cfg: CNNConfig | None = None) -> nn.Sequential:
    """Build the classifier; ``len(model) == cfg.depth + 3``.

    Args:
        cfg: model shape; ``CNNConfig()`` when omitted.

    Returns:
        A module mapping float images (N, in_channels, H, W) to logits (N, num_classes).

    Example:
        >>> model = build_cnn(CNNConfig(width=8))
        >>> model(torch.zeros(4, 1, 8, 8)).shape
        torch.Size([4, 10])
    """
    cfg = cfg if cfg is not None else CNNConfig()
    grid = min(_POOLED_GRID, cfg.image_size)
    return nn.Sequential(
        ConvBlock(cfg.in_channels, cfg.width),
        *(ResidualBlock(cfg.width) for _ in range(cfg.depth - 1)),
        nn.AdaptiveAvgPool2d(grid),
        nn.Flatten(),
        nn.Linear(cfg.width * grid * grid, cfg.num_classes),
    )


def cnn_layer_init(cfg: CNNConfig) -> Callable[[int, nn.Module], None]:
    """The per-layer initialiser: torch's default (``reset_parameters``, which BatchNorm
    extends to its running statistics), as :func:`build_cnn` leaves the layers."""
    del cfg
    return reset_parameters


def cnn_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of logits (N, num_classes) against class ids (N,)."""
    return F.cross_entropy(logits, targets)
