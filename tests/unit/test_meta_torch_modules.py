"""torch's own modules built on the meta device materialise with their own initialisation
when no ``init`` is given, including those that name it ``_reset_parameters``
(``nn.MultiheadAttention``, so ``nn.TransformerEncoderLayer`` and ``nn.Transformer``)."""

from __future__ import annotations

import torch
from torch import nn

from syncline.models.meta_init import cpu_seeded, own_reset
from syncline.models.meta_modules import materialize_modules, module_seed


class EncoderLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True)
        self.body = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(ids)))


def test_a_transformer_encoder_built_on_meta_materialises_without_an_init() -> None:
    with torch.device("meta"):
        model = EncoderLM()
    materialize_modules(model, seed=3)
    state = model.state_dict()
    assert all(torch.isfinite(t).all() for t in state.values())
    attn = model.body.layers[0].self_attn
    assert torch.equal(attn.in_proj_bias, torch.zeros_like(attn.in_proj_bias))  # its own rule
    # exactly MultiheadAttention._reset_parameters under the module's seed
    with torch.device("meta"):
        twin = nn.MultiheadAttention(16, 2, batch_first=True)
    twin = twin.to_empty(device="cpu")
    with cpu_seeded(module_seed(3, "body.layers.0.self_attn")), torch.no_grad():
        twin._reset_parameters()
    assert torch.equal(twin.in_proj_weight, attn.in_proj_weight)
    assert model(torch.randint(0, 64, (2, 5))).shape == (2, 5, 64)


def test_own_reset_finds_either_name() -> None:
    assert own_reset(nn.Linear(2, 2)) is not None
    assert own_reset(nn.MultiheadAttention(4, 2)) is not None
    assert own_reset(nn.ReLU()) is None
