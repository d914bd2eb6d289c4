"""GPT reference model: shapes, structure, weight tying, causality, init, training, FLOPs."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from syncline.data import ByteDataset, ShardedBatches, stdlib_corpus
from syncline.errors import ConfigError
from syncline.models.gpt import (
    Block,
    Embedding,
    GPTConfig,
    Head,
    build_gpt,
    gpt_flops_per_token,
    lm_loss,
)

TINY = GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Tiny models gain nothing from intra-op threads and stall badly when the cores are
    shared with other test processes, so the training tests run single-threaded."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@functools.cache
def _tiny_model() -> nn.Sequential:
    torch.manual_seed(0)
    return build_gpt(TINY).eval()


def _tokens(b: int, t: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(TINY.vocab_size, (b, t), generator=gen)


def test_structure_is_embedding_blocks_head() -> None:
    model = _tiny_model()
    assert isinstance(model, nn.Sequential)
    assert len(model) == TINY.n_layer + 2
    assert isinstance(model[0], Embedding)
    assert all(isinstance(m, Block) for m in model[1:-1])
    assert isinstance(model[-1], Head)


@settings(max_examples=15, deadline=None)
@given(b=st.integers(1, 3), t=st.integers(1, TINY.block_size))
def test_output_shapes(b: int, t: int) -> None:
    model = _tiny_model()
    x = _tokens(b, t)
    h = model[0](x)
    assert h.shape == (b, t, TINY.n_embd)
    assert model[1](h).shape == (b, t, TINY.n_embd)
    assert model(x).shape == (b, t, TINY.vocab_size)


def test_sequence_longer_than_block_size_is_rejected() -> None:
    with pytest.raises(ConfigError, match="sequence length 17 exceeds block_size=16"):
        _tiny_model()(_tokens(1, TINY.block_size + 1))


@pytest.mark.parametrize("cut", range(1, TINY.n_layer + 2))
def test_cutting_into_stages_gives_the_same_output(cut: int) -> None:
    model = _tiny_model()
    x = _tokens(2, 8)
    with torch.no_grad():
        torch.testing.assert_close(model[cut:](model[:cut](x)), model(x), rtol=0, atol=0)


def test_changing_a_future_token_leaves_earlier_logits_unchanged() -> None:
    model = _tiny_model()
    x = _tokens(2, TINY.block_size)
    k = 9
    x2 = x.clone()
    x2[:, k] = (x[:, k] + 1) % TINY.vocab_size
    with torch.no_grad():
        a, b = model(x), model(x2)
    torch.testing.assert_close(a[:, :k], b[:, :k], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, k], b[:, k])


def test_tied_weights_are_one_parameter_listed_once() -> None:
    tied = build_gpt(GPTConfig(n_layer=1, n_embd=32, tie_weights=True))
    assert tied[-1].lm_head.weight is tied[0].wte.weight
    params = list(tied.parameters())
    assert sum(p is tied[0].wte.weight for p in params) == 1
    untied = build_gpt(GPTConfig(n_layer=1, n_embd=32))
    assert untied[-1].lm_head.weight is not untied[0].wte.weight
    n_tied = sum(p.numel() for p in params)
    n_untied = sum(p.numel() for p in untied.parameters())
    assert n_untied - n_tied == 256 * 32


def test_init_is_deterministic_under_manual_seed() -> None:
    states = []
    for _ in range(2):
        torch.manual_seed(123)
        states.append(build_gpt(TINY).state_dict())
    assert states[0].keys() == states[1].keys()
    for name in states[0]:
        torch.testing.assert_close(states[0][name], states[1][name], rtol=0, atol=0)
    torch.manual_seed(124)
    other = build_gpt(TINY).state_dict()
    assert not torch.equal(other["0.wte.weight"], states[0]["0.wte.weight"])


def test_init_follows_nanogpt() -> None:
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=4, n_embd=128)
    model = build_gpt(cfg)
    params = dict(model.named_parameters())
    resid_std = 0.02 / math.sqrt(2 * cfg.n_layer)
    for name, p in params.items():
        if name.endswith("c_proj.weight"):
            assert p.std().item() == pytest.approx(resid_std, rel=0.05), name
        elif name.endswith("bias") and "ln" not in name:
            assert torch.count_nonzero(p) == 0, name
        elif p.dim() == 2:
            assert p.std().item() == pytest.approx(0.02, rel=0.05), name
    # small logits at init: the loss is close to that of a uniform guess
    x = _tokens(4, 32)
    with torch.no_grad():
        loss = lm_loss(model(x), _tokens(4, 32, seed=1))
    assert loss.item() == pytest.approx(math.log(cfg.vocab_size), abs=0.1)


def test_lm_loss_is_cross_entropy_over_flattened_positions() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 5, generator=gen)
    targets = torch.randint(5, (2, 3), generator=gen)
    by_hand = -torch.log_softmax(logits, -1).gather(-1, targets[..., None]).mean()
    torch.testing.assert_close(lm_loss(logits, targets), by_hand)


@pytest.mark.usefixtures("one_thread")
def test_loss_drops_in_30_adam_steps_on_stdlib_text() -> None:
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=32, n_layer=2, n_head=4, n_embd=64)
    model = build_gpt(cfg)
    data = ByteDataset(stdlib_corpus(50_000), cfg.block_size)
    batches = ShardedBatches(data, global_batch=16, rank=0, world_size=1, seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for step in range(30):
        x, y = batches.batch(step)
        loss = lm_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(256), abs=0.2)
    # typically ~5.5 -> ~3.2; demand a clear but loose drop
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0


def test_flops_per_token_closed_form() -> None:
    # L=4, C=128, V=256, T=64: N = 4*12*128^2 + 128*256 = 819_200; 6N + 12*L*C*T
    assert gpt_flops_per_token(GPTConfig()) == 6 * 819_200 + 12 * 4 * 128 * 64 == 5_308_416
    assert gpt_flops_per_token(GPTConfig(), seq_len=1) == 6 * 819_200 + 12 * 4 * 128
    assert gpt_flops_per_token(GPTConfig(tie_weights=True)) == 5_308_416


def test_flops_count_the_models_matmul_weights() -> None:
    cfg = GPTConfig(n_layer=3, n_embd=64, block_size=16)
    model = build_gpt(cfg)
    n_matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    attention = 12 * cfg.n_layer * cfg.n_embd * cfg.block_size
    assert gpt_flops_per_token(cfg) == 6 * n_matmul + attention


@pytest.mark.parametrize("seq_len", [0, 65])
def test_flops_reject_bad_seq_len(seq_len: int) -> None:
    with pytest.raises(ConfigError, match=f"seq_len={seq_len}"):
        gpt_flops_per_token(GPTConfig(), seq_len=seq_len)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"n_embd": 130}, "n_embd=130 is not divisible by n_head=4"),
        ({"vocab_size": 0}, "vocab_size=0"),
        ({"block_size": -1}, "block_size=-1"),
        ({"n_layer": 0}, "n_layer=0"),
        ({"n_head": True}, "n_head=True"),
        ({"n_embd": 64.0}, "n_embd=64.0"),
        ({"dropout": 1.0}, "dropout=1.0"),
        ({"dropout": -0.1}, "dropout=-0.1"),
        ({"tie_weights": 1}, "tie_weights=1"),
    ],
)
def test_config_rejects_bad_values(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        GPTConfig(**overrides)  # type: ignore[arg-type]


def test_dropout_is_active_only_in_training() -> None:
    torch.manual_seed(0)
    model = build_gpt(GPTConfig(block_size=8, n_layer=1, n_embd=32, dropout=0.5))
    x = _tokens(2, 8)
    with torch.no_grad():
        assert not torch.equal(model.train()(x), model(x))
        assert torch.equal(model.eval()(x), model(x))
