"""Models as their users build them go through the pipeline splitter: a HuggingFace GPT-2
from its default config (``use_cache=True``) is traced without its cache and split equal to
the whole model, BERT too (its submodule named ``self``); a model the tracer cannot take is
refused in one line naming it."""

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


def test_a_default_config_bert_splits_exactly_despite_its_submodule_named_self() -> None:
    """BERT's ``attention.self`` became a value named ``self`` in the stages' generated code,
    overwriting the module ("'Tensor' object has no attribute 'output'")."""
    config = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        vocab_size=64, max_position_embeddings=16,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(config).eval()
    ids = torch.randint(0, 64, (2, 8))
    traced = trace_model(model, ["bert.encoder.layer.1"], {"input_ids": ids})
    out = traced.forward({"input_ids": ids})
    logits = out if isinstance(out, torch.Tensor) else out["logits"]
    assert torch.equal(logits, model(input_ids=ids).logits)


class _NamedSelf(nn.Module):
    """A child registered under the name ``self``, called in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.add_module("self", nn.Linear(4, 4))
        self.out = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.self(x))


class _TwoNamedSelf(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = _NamedSelf(), _NamedSelf()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def test_a_child_module_named_self_runs_in_generated_code() -> None:
    torch.manual_seed(0)
    model = _TwoNamedSelf()
    x = torch.randn(2, 4)
    traced = trace_model(model, ["b"], {"x": x})
    assert torch.equal(traced.forward({"x": x}), model(x))


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


class _BuiltinNamed(nn.Module):
    """A forward whose argument is named like a builtin (``input``, as many torch modules)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(input))


def test_a_model_input_named_like_a_builtin_reaches_its_stage() -> None:
    """Its placeholder is ``input_1`` but the generated forward's parameter is ``input``:
    stages take their inputs by position."""
    torch.manual_seed(0)
    model = _BuiltinNamed()
    x = torch.randn(2, 4)
    traced = trace_model(model, ["b"], {"input": x})
    assert torch.equal(traced.forward({"input": x}), model(x))
