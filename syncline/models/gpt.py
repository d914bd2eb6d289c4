"""A small GPT-style byte-level language model, built as a flat nn.Sequential of blocks.

The model is ``Embedding -> Block x n_layer -> Head``, each a self-contained module that
maps one tensor to one tensor, so that a pipeline partitioner can cut the sequence into
stages anywhere. The architecture and the initialisation follow nanoGPT
(https://github.com/karpathy/nanoGPT, ``model.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from syncline.errors import ConfigError
from syncline.models.configs import GPTConfig

__all__ = [
    "Block",
    "Embedding",
    "GPTConfig",
    "Head",
    "build_gpt",
    "gpt_flops_per_token",
    "gpt_layer_init",
    "lm_loss",
]

_INIT_STD = 0.02


class Embedding(nn.Module):
    """Token plus learned position embeddings: LongTensor (B, T) -> (B, T, C)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.block_size = cfg.block_size
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[-1]
        if t > self.block_size:
            raise ConfigError(
                f"sequence length {t} exceeds block_size={self.block_size}; "
                f"valid: T <= {self.block_size}"
            )
        pos = torch.arange(t, device=idx.device)
        h: torch.Tensor = self.drop(self.wte(idx) + self.wpe(pos))
        return h


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t attends only to positions <= t."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        # (B, T, C) -> (B, H, T, C/H)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        out: torch.Tensor = self.resid_drop(self.c_proj(y))
        return out


class MLP(nn.Module):
    """Position-wise feed-forward network, 4x wide, GELU."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.drop(self.c_proj(self.gelu(self.c_fc(x))))
        return out


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class Head(nn.Module):
    """Final LayerNorm and projection to the vocabulary: (B, T, C) -> logits (B, T, V)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.lm_head(self.ln_f(x))
        return logits


def _init_weights(model: nn.Module, n_layer: int) -> None:
    """nanoGPT init: N(0, 0.02) for Linear and Embedding weights, zero biases, and the
    projections that write into the residual stream scaled by 1/sqrt(2 * n_layer) (GPT-2);
    LayerNorm to ones and zeros. ``model``: the whole model or one of its layers."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=_INIT_STD)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=_INIT_STD)
        elif isinstance(module, nn.LayerNorm):
            module.reset_parameters()
    for name, param in model.named_parameters():
        if name.endswith("c_proj.weight"):
            nn.init.normal_(param, mean=0.0, std=_INIT_STD / math.sqrt(2 * n_layer))


def gpt_layer_init(cfg: GPTConfig) -> Callable[[int, nn.Module], None]:
    """The per-layer initialiser (``init(index, layer)``) of a GPT of shape ``cfg``: the
    nanoGPT init of :func:`build_gpt`, one layer at a time, for models built on the meta
    device (:mod:`syncline.models.meta_init`)."""

    def init(index: int, layer: nn.Module) -> None:
        del index
        _init_weights(layer, cfg.n_layer)

    return init


def build_gpt(cfg: GPTConfig | None = None) -> nn.Sequential:
    """Build a GPT as ``nn.Sequential(Embedding, Block * n_layer, Head)``.

    The initialisation draws from torch's global generator only, so two calls after the
    same ``torch.manual_seed`` give identical weights.

    Args:
        cfg: model shape; ``GPTConfig()`` when omitted.

    Returns:
        A module mapping LongTensor (B, T), T <= block_size, to logits (B, T, vocab_size);
        ``len(model) == cfg.n_layer + 2``.

    Example:
        >>> model = build_gpt(GPTConfig(n_layer=2, n_embd=32))
        >>> model(torch.zeros(3, 10, dtype=torch.long)).shape
        torch.Size([3, 10, 256])
    """
    cfg = cfg if cfg is not None else GPTConfig()
    embedding = Embedding(cfg)
    blocks = [Block(cfg) for _ in range(cfg.n_layer)]
    head = Head(cfg)
    if cfg.tie_weights:
        head.lm_head.weight = embedding.wte.weight
    model = nn.Sequential(embedding, *blocks, head)
    _init_weights(model, cfg.n_layer)
    return model


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of logits (B, T, V) against targets (B, T)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def gpt_flops_per_token(cfg: GPTConfig, seq_len: int | None = None) -> int:
    """Training FLOPs (forward + backward) per token, for tokens/s and MFU reporting.

    ``6 * N + 12 * n_layer * n_embd * T``: the 6N rule of Kaplan et al. 2020, "Scaling Laws
    for Neural Language Models", Table 1 (2N forward, twice that backward), plus the
    attention-score and attention-value matmuls as counted by nanoGPT's ``estimate_mfu``
    (after PaLM, Chowdhery et al. 2022, Appendix B). N counts the weights that take part in
    matrix multiplies: 12 * n_embd**2 per block and n_embd * vocab_size for the head;
    embedding lookups, biases and LayerNorms are left out. The head is counted whether or
    not it is tied, since tying shares storage, not compute.

    Args:
        cfg: model shape.
        seq_len: sequence length T the model is run at; ``cfg.block_size`` when omitted.

    Returns:
        FLOPs per token as an int.

    Raises:
        ConfigError: if ``seq_len`` is not in [1, block_size].
    """
    t = cfg.block_size if seq_len is None else seq_len
    if not 1 <= t <= cfg.block_size:
        raise ConfigError(f"seq_len={seq_len} is invalid; valid: 1 <= seq_len <= {cfg.block_size}")
    c = cfg.n_embd
    n_matmul = cfg.n_layer * 12 * c * c + c * cfg.vocab_size
    return 6 * n_matmul + 12 * cfg.n_layer * c * t
