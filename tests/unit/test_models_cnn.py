"""CNN reference model and the model registry."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from syncline.data import ShardedBatches, TensorPairDataset, digits_dataset, synthetic_images
from syncline.errors import ConfigError
from syncline.models import (
    MODELS,
    CNNConfig,
    build_cnn,
    build_model,
    cnn_loss,
    lm_loss,
    model_loss,
)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Tiny models gain nothing from intra-op threads and stall badly when the cores are
    shared with other test processes, so the training tests run single-threaded."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    "cfg",
    [CNNConfig(), CNNConfig(in_channels=3, num_classes=4, image_size=12, width=8, depth=1)],
)
def test_output_shape_and_structure(cfg: CNNConfig) -> None:
    model = build_cnn(cfg)
    assert isinstance(model, nn.Sequential)
    assert len(model) == cfg.depth + 3
    x = torch.zeros(5, cfg.in_channels, cfg.image_size, cfg.image_size)
    assert model(x).shape == (5, cfg.num_classes)


def test_batchnorm_running_stats_are_buffers_updated_in_training() -> None:
    torch.manual_seed(0)
    model = build_cnn(CNNConfig(width=8))
    buffers = dict(model.named_buffers())
    assert any(name.endswith("running_mean") for name in buffers)
    before = {name: b.clone() for name, b in buffers.items()}
    model.train()(torch.randn(16, 1, 8, 8))
    after = dict(model.named_buffers())
    assert not torch.equal(before["0.bn.running_mean"], after["0.bn.running_mean"])
    assert after["0.bn.num_batches_tracked"].item() == 1


def test_init_is_deterministic_under_manual_seed() -> None:
    states = []
    for _ in range(2):
        torch.manual_seed(7)
        states.append(build_cnn().state_dict())
    for name in states[0]:
        assert torch.equal(states[0][name], states[1][name]), name


@pytest.mark.usefixtures("one_thread")
def test_learns_synthetic_images() -> None:
    torch.manual_seed(0)
    cfg = CNNConfig(width=16)
    model = build_cnn(cfg)
    x, y = synthetic_images(256, cfg.image_size, cfg.num_classes, seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(30):
        idx = torch.arange(step * 32, step * 32 + 32) % len(x)
        loss = cnn_loss(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # typically ~2.3 -> ~0.01; demand a clear but loose drop
    assert sum(losses[-5:]) / 5 < 0.25 * losses[0]


@pytest.mark.usefixtures("one_thread")
def test_learns_digits() -> None:
    torch.manual_seed(0)
    model = build_cnn(CNNConfig(width=16))
    batches = ShardedBatches(TensorPairDataset(*digits_dataset()), 64, rank=0, world_size=1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(30):
        x, y = batches.batch(step)
        loss = cnn_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # typically ~2.4 -> ~0.2
    assert sum(losses[-5:]) / 5 < 0.5 * losses[0]


@pytest.mark.parametrize(
    ("field", "value"),
    [("in_channels", 0), ("num_classes", -2), ("image_size", 0), ("width", 1.5), ("depth", 0)],
)
def test_config_rejects_bad_values(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"CNNConfig.{field}={value!r}"):
        CNNConfig(**{field: value})  # type: ignore[arg-type]


def test_registry_builds_each_model_with_overrides() -> None:
    assert MODELS.names()[:2] == ("gpt", "cnn")
    gpt = build_model("gpt", n_layer=1, n_embd=32, block_size=8)
    assert len(gpt) == 3
    assert gpt(torch.zeros(2, 8, dtype=torch.long)).shape == (2, 8, 256)
    cnn = build_model("cnn", width=8, depth=3)
    assert len(cnn) == 6
    assert model_loss("gpt") is lm_loss
    assert model_loss("cnn") is cnn_loss


def test_registry_rejects_unknown_names() -> None:
    with pytest.raises(ConfigError) as err:
        build_model("x")
    assert str(err.value) == "model='x' is unknown; valid: gpt, cnn"
    with pytest.raises(ConfigError, match="model='resnet' is unknown"):
        model_loss("resnet")
    with pytest.raises(ConfigError, match="unknown option 'layers' for model 'gpt'; valid: "):
        build_model("gpt", layers=2)
    with pytest.raises(ConfigError, match="n_head=3"):
        build_model("gpt", n_head=3)
