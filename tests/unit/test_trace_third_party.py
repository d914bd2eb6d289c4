"""Models as their users build them go through the pipeline splitter: a HuggingFace GPT-2
from its default config (``use_cache=True``) is traced without its cache and split equal to
the whole model; a model the tracer cannot take is refused in one line naming it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from syncline.errors import ConfigError
from syncline.pipeline.trace import trace_model

transformers = pytest.importorskip("transformers")


def test_a_default_config_gpt2_is_traced_without_its_cache_and_splits_exactly() -> None:
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    assert config.use_cache is True  # as built by default
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 64, (2, 8))
    traced = trace_model(model, ["transformer.h.1"], {"input_ids": ids})
    assert len(traced.stages) == 2 and model.config.use_cache is True  # left as it was
    out = traced.forward({"input_ids": ids})
    logits = out if isinstance(out, torch.Tensor) else out["logits"]
    assert torch.allclose(logits, model(input_ids=ids).logits, atol=1e-6)


class _Branchy(nn.Module):
    """Python control flow on a tensor's value: no single graph can hold it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.sum() > 0:
            h = h * 2
        return self.b(h)


def test_a_model_the_tracer_cannot_take_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError) as err:
        trace_model(_Branchy(), ["b"], {"x": torch.randn(2, 4)})
    message = str(err.value)
    assert "\n" not in message and "_Branchy" in message and "split_points=['b']" in message
