"""The model zoo: the small models the tests build, their data and single-process references."""

from __future__ import annotations

import copy
from collections.abc import Callable, Collection, Iterable

import torch
from torch import nn

from syncline.models import build_model, lm_loss

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]

# ---------------------------------------------------------------------------------------------
# a tiny GPT and its byte batches (the pipeline tests)

LM_STEPS = 5
LM_BATCH = 8
TINY_GPT = {"n_layer": 2, "n_embd": 16, "n_head": 2, "block_size": 8}


def tiny_gpt(**overrides: object) -> nn.Sequential:
    """A 2-block GPT (4 layers: embedding, 2 blocks, head), initialised from seed 0."""
    torch.manual_seed(0)
    return build_model("gpt", **{**TINY_GPT, **overrides})


def lm_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``LM_STEPS`` global batches of ``LM_BATCH`` sequences; the sequence length changes from
    step to step (8, 5, 8, ...), so activations of a new shape must flow without any setup."""
    g = torch.Generator().manual_seed(1)
    out = []
    for step in range(LM_STEPS):
        x = torch.randint(0, 256, (LM_BATCH, 8 if step % 2 == 0 else 5), generator=g)
        out.append((x, torch.roll(x, -1, dims=1)))
    return out


def reference_training(
    model: nn.Module,
    optimizer: OptimizerFactory,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    stale: bool,
    flushed_before: Collection[int] = (),
) -> list[float]:
    """Train ``model`` in one process on whole batches; returns the loss of every step.

    ``stale`` applies 2BW's rule: W(t+1) = W(t) - lr * grad f(W(t-1)), W(-1) = W(0), i.e. the
    gradient is taken on a copy one step behind and applied to the newest weights (the
    optimizer and its state act on the newest); except at the steps in ``flushed_before``,
    which a 2BW pipeline starts after a flush, on the newest weights.
    """
    opt = optimizer(model.parameters())
    behind = copy.deepcopy(model)
    losses = []
    for step, (x, y) in enumerate(batches):
        where = behind if stale and step not in flushed_before else model
        where.zero_grad()
        loss = loss_fn(where(x), y)
        loss.backward()
        losses.append(loss.item())
        newest = copy.deepcopy(model.state_dict())
        for p, q in zip(model.parameters(), where.parameters(), strict=True):
            p.grad = q.grad.clone()
        opt.step()
        behind.load_state_dict(newest)
    return losses


def lm_reference(
    optimizer: OptimizerFactory, *, stale: bool, flushed_before: Collection[int] = ()
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """``tiny_gpt`` trained in one process on the whole batches of ``lm_batches`` (``stale``:
    2BW's rule, see :func:`reference_training`).

    Returns:
        The final state dict and the loss of every step.
    """
    model = tiny_gpt()
    losses = reference_training(
        model, optimizer, lm_batches(), lm_loss, stale=stale, flushed_before=flushed_before
    )
    return model.state_dict(), losses


# ---------------------------------------------------------------------------------------------
# toy models that exercise the awkward cases of data parallelism: frozen, tied, unused, BatchNorm


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


TOY_MODELS: dict[str, type[nn.Module]] = {
    "frozen": Frozen,
    "tied": Tied,
    "unused": Unused,
    "bn": WithBN,
}


def toy_model(name: str) -> nn.Module:
    """The toy model ``name`` of ``TOY_MODELS``, initialised from seed 1234."""
    torch.manual_seed(1234)
    return TOY_MODELS[name]()


def toy_batch(name: str, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
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


# ---------------------------------------------------------------------------------------------
# a factory's model that is no nn.Sequential (``--model tests.zoo.models:split_lm``)


class SplitLM(nn.Module):
    """A byte-level language model as a user writes one: a pipeline cuts it at split points
    (``body``), never by layers."""

    def __init__(self, seq_len: int, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.pos = nn.Parameter(torch.zeros(seq_len, width))
        self.body = nn.Sequential(nn.Linear(width, width), nn.Tanh())
        self.head = nn.Linear(width, 256)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(ids) + self.pos[: ids.shape[1]]))


def split_lm(seq_len: int, width: int = 16) -> nn.Module:
    """The factory ``syncline train --model tests.zoo.models:split_lm`` calls."""
    return SplitLM(seq_len, width)
