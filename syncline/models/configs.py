"""PURE: the shapes of the reference models, as dataclasses checked on creation.

Kept apart from the ``nn.Module`` code so that configuration checks (the model registry,
``TrainConfig``, the command line) run without loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from syncline.errors import ConfigError
from syncline.fields import check_int

__all__ = ["CNNConfig", "GPTConfig"]


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT model (nanoGPT's, byte-level by default)."""

    vocab_size: int = 256
    """Number of token ids; 256 for raw bytes."""
    block_size: int = 64
    """Longest sequence the model accepts (size of the position table)."""
    n_layer: int = 4
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide ``n_embd``."""
    n_embd: int = 128
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout probability in [0, 1) on embeddings, attention and MLP outputs."""
    tie_weights: bool = False
    """Share one Parameter between the token embedding and the output head. Under pipeline
    parallelism the first and last stage then hold the same weight, so keep them on one
    device or synchronise its gradient."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            check_int(f"GPTConfig.{name}", getattr(self, name))
        if self.n_embd % self.n_head != 0:
            raise ConfigError(
                f"GPTConfig.n_embd={self.n_embd} is not divisible by n_head={self.n_head}; "
                f"valid: n_embd a multiple of n_head"
            )
        if not isinstance(self.dropout, int | float) or not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"GPTConfig.dropout={self.dropout!r} is invalid; valid: 0 <= p < 1")
        if not isinstance(self.tie_weights, bool):
            raise ConfigError(
                f"GPTConfig.tie_weights={self.tie_weights!r} is invalid; valid: True or False"
            )


@dataclass(frozen=True)
class CNNConfig:
    """Shape of a CNN classifier (a small ResNet with BatchNorm)."""

    in_channels: int = 1
    """Channels of the input images (1 for grey scale)."""
    num_classes: int = 10
    """Number of output logits."""
    image_size: int = 8
    """Side of the square input images; the pooled grid is ``min(4, image_size)`` on a
    side. The adaptive pool lets the network accept other sizes too."""
    width: int = 32
    """Channels of every convolution."""
    depth: int = 2
    """Conv-BatchNorm-ReLU blocks, the first a stem mapping ``in_channels`` to ``width``,
    the rest residual."""

    def __post_init__(self) -> None:
        for name in ("in_channels", "num_classes", "image_size", "width", "depth"):
            check_int(f"CNNConfig.{name}", getattr(self, name))
