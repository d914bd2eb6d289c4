"""Third-party models as their users build them (HuggingFace's from default configs with only
the size shrunk; an ``nn.TransformerEncoder`` LM built on the meta device), their batches,
and a one-process reference that trains the unsplit model on the pipeline's micro-batches."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

Inputs = dict[str, torch.Tensor]
Batch = tuple[Inputs, torch.Tensor]
VOCAB, SEQ = 100, 8
#: only the size is shrunk from each default config (and dropout off where it is on by
#: default: a split run draws its dropout masks from other generators than one process)
SMALL = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
         "intermediate_size": 64, "vocab_size": VOCAB, "max_position_embeddings": 32}  # fmt: skip


def _transformers() -> Any:
    import transformers  # an optional test dependency: callers importorskip it first

    return transformers


def bert() -> nn.Module:
    """``BertForMaskedLM`` from its default config, shrunk."""
    t = _transformers()
    config = t.BertConfig(**SMALL, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    return t.BertForMaskedLM(config)


def llama() -> nn.Module:
    """``LlamaForCausalLM`` from its default config (``use_cache=True``), shrunk."""
    t = _transformers()
    config = t.LlamaConfig(**SMALL, num_key_value_heads=2)
    assert config.use_cache  # as built by default: the pipeline turns it off while tracing
    torch.manual_seed(0)
    return t.LlamaForCausalLM(config)


class EncoderLM(nn.Module):
    """A language model from torch's own ``nn.TransformerEncoder`` (its attention
    initialises itself in ``_reset_parameters``)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.body = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(input_ids)))


def meta_encoder() -> nn.Module:
    """``EncoderLM`` on the meta device: shapes only, no memory, no initialisation yet."""
    with torch.device("meta"):
        return EncoderLM()


def logits(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.logits


def causal_loss(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy (labels of -100 ignored)."""
    return F.cross_entropy(out[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def masked_loss(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross entropy on the masked positions (the rest are -100)."""
    return F.cross_entropy(out.flatten(0, 1), labels.flatten())


def causal_batches(steps: int, batch: int, seed: int = 1) -> list[Batch]:
    """Token batches with an attention mask padding some rows (their labels -100)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
        mask = torch.ones(batch, SEQ, dtype=torch.long)
        mask[::3, -3:] = 0
        out.append(({"input_ids": ids, "attention_mask": mask}, ids.masked_fill(mask == 0, -100)))
    return out


def ids_batches(steps: int, batch: int, seed: int = 1) -> list[Batch]:
    """Token batches with no mask (a model whose forward takes ``input_ids`` only)."""
    return [({"input_ids": x["input_ids"]}, y) for x, y in causal_batches(steps, batch, seed)]


def masked_batches(steps: int, batch: int, seed: int = 1) -> list[Batch]:
    """BERT's objective: about 15 % of the tokens replaced by a [MASK] id (here 1), the
    labels the original tokens there and -100 elsewhere; at least one per row."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(2, VOCAB, (batch, SEQ), generator=g)
        chosen = torch.rand(batch, SEQ, generator=g) < 0.15
        chosen[:, 0] = True
        out.append(({"input_ids": ids.masked_fill(chosen, 1)}, ids.masked_fill(~chosen, -100)))
    return out


def microbatch_reference(
    model: nn.Module,
    optimizer: Callable[[Any], torch.optim.Optimizer],
    batches: list[Batch],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    parts: int,
    *,
    stale: bool,
) -> list[float]:
    """Train the unsplit ``model`` in one process on ``parts`` micro-batches per batch, each
    loss divided by ``parts`` (as a pipeline's); ``stale``: 2BW's rule, the gradient taken on
    the weights one step behind (``W(t+1) = W(t) - lr * grad f(W(t-1))``). Returns the
    losses."""
    behind = copy.deepcopy(model)
    opt = optimizer(model.parameters())
    losses = []
    for step, (inputs, target) in enumerate(batches):
        where = behind if stale and step > 0 else model
        where.zero_grad()
        total = 0.0
        size = target.shape[0] // parts
        for i in range(parts):
            rows = slice(i * size, (i + 1) * size)
            loss = loss_fn(logits(where(**{k: v[rows] for k, v in inputs.items()})), target[rows])
            (loss / parts).backward()
            total += loss.item() / parts
        losses.append(total)
        newest = copy.deepcopy(model.state_dict())
        for p, q in zip(model.parameters(), where.parameters(), strict=True):
            p.grad = None if q.grad is None else q.grad.clone()
        opt.step()
        behind.load_state_dict(newest)
    return losses
