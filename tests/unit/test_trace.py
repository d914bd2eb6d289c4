"""Any model split at named points (issue 13, part 2, first piece): torch's splitter, and what
syncline adds so the stages are safe to train.

A HuggingFace GPT-2 built from a small config (tied input embedding and output head kept,
an attention mask as a keyword input, two values crossing the split) and a HuggingFace
ResNet (BatchNorm, residual branches) are split at module names; run stage by stage in one
process, with every boundary cut as a pipeline cuts it (detached, gradients handed back by
hand), they give the unsplit model's outputs and gradients exactly, the tied weight's two
copies summed. A micro-batch of another shape, which the trace cannot follow, is refused.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from syncline.errors import ConfigError
from syncline.pipeline.trace import TracedModel, resolve, trace_model

transformers = pytest.importorskip("transformers")


def _gpt2() -> torch.nn.Module:
    cfg = transformers.GPT2Config(
        n_layer=4, n_embd=32, n_head=2, vocab_size=100, n_positions=16, use_cache=False,
        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    assert model.transformer.wte.weight is model.lm_head.weight
    return model


def _resnet() -> torch.nn.Module:
    cfg = transformers.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=10
    )
    torch.manual_seed(0)
    return transformers.ResNetForImageClassification(cfg)


def _lm_inputs(batch: int = 2, seq: int = 8) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 100, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, -2:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _logits(out):
    return out if isinstance(out, torch.Tensor) else out.logits


def _pipelined(traced: TracedModel, inputs, loss_of) -> torch.Tensor:
    """Forward stage by stage with every crossing value detached (as between ranks), then
    backward stage by stage, handing each stage its outputs' gradients."""
    outputs, received = [], []
    for stage, names, sources in zip(
        traced.stages, traced.placeholders, traced.sources, strict=True
    ):
        args = {}
        for name, source in zip(names, sources, strict=True):
            value = resolve(source, inputs, outputs)
            if source.stage is not None and value.is_floating_point():
                value = value.detach().requires_grad_()
            args[name] = value
        received.append(args)
        outputs.append(stage(**args))
    loss = loss_of(_logits(outputs[-1]))
    loss.backward()
    for index in reversed(range(len(traced.stages) - 1)):
        out = outputs[index]
        values = [out] if isinstance(out, torch.Tensor) else list(out)
        grads = [torch.zeros_like(v) if v.is_floating_point() else None for v in values]
        for later in range(index + 1, len(traced.stages)):
            for name, source in zip(traced.placeholders[later], traced.sources[later], strict=True):
                grad = received[later][name].grad if source.stage == index else None
                if grad is not None:
                    grads[source.index or 0] += grad
        pairs = [(v, g) for v, g in zip(values, grads, strict=True) if v.requires_grad]
        torch.autograd.backward([v for v, _ in pairs], [g for _, g in pairs])
    return loss


def _assert_same_grads(traced: TracedModel, reference: torch.nn.Module) -> None:
    summed: dict[str, torch.Tensor] = {}
    for stage, names in zip(traced.stages, traced.canonical, strict=True):
        for name, p in stage.named_parameters():
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            key = names[name]
            summed[key] = grad.clone() if key not in summed else summed[key] + grad
    want = dict(reference.named_parameters())
    assert summed.keys() == want.keys()
    for key, grad in summed.items():
        torch.testing.assert_close(grad, want[key].grad, atol=1e-6, rtol=0, msg=key)


def test_gpt2_with_tied_embeddings_and_a_mask_splits_exactly() -> None:
    model = _gpt2()
    reference = copy.deepcopy(model)
    inputs = _lm_inputs()
    traced = trace_model(model, ["transformer.h.2"], inputs)
    assert len(traced.stages) == 2
    assert [s.name for s in traced.sources[0]] == list(traced.placeholders[0])
    crossing = [s for s in traced.sources[1] if s.stage == 0]
    assert len(crossing) == 2  # the hidden state and the expanded attention mask
    # the tied pair: a copy on each stage, under each stage's own name, one canonical name
    assert traced.tied == [{0: "transformer.wte.weight", 1: "lm_head.weight"}]
    assert traced.canonical[1]["lm_head.weight"] == "transformer.wte.weight"
    assert "lm_head.weight" not in dict(traced.stages[0].named_parameters())  # stray pruned
    assert "transformer.h.3.attn.c_attn.weight" in dict(traced.stages[1].named_parameters())
    labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)

    def loss_of(logits):
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())

    with torch.no_grad():
        torch.testing.assert_close(
            _logits(traced.forward(inputs)), reference(**inputs).logits, atol=0, rtol=0
        )
    loss = _pipelined(traced, inputs, loss_of)
    want = loss_of(reference(**inputs).logits)
    want.backward()
    assert loss.item() == want.item()
    _assert_same_grads(traced, reference)
    # neither copy alone is the gradient: the stages must sum them before a step
    head = dict(traced.stages[1].named_parameters())["lm_head.weight"].grad
    assert not torch.allclose(head, reference.transformer.wte.weight.grad, atol=1e-4)


def test_a_resnet_with_batchnorm_splits_exactly() -> None:
    model = _resnet()
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(2)
    inputs = {"pixel_values": torch.randn(4, 3, 16, 16, generator=g)}
    labels = torch.randint(0, 10, (4,), generator=g)
    traced = trace_model(model, ["resnet.encoder.stages.1"], inputs)
    assert traced.tied == []

    def loss_of(logits):
        return F.cross_entropy(logits, labels)

    loss = _pipelined(traced, inputs, loss_of)
    want = loss_of(reference(**inputs).logits)
    want.backward()
    assert loss.item() == pytest.approx(want.item(), abs=1e-6)
    _assert_same_grads(traced, reference)
    # BatchNorm's running statistics moved in the stage modules as in the reference
    ref_buffers = dict(reference.named_buffers())
    for stage in traced.stages:
        for name, buf in stage.named_buffers():
            torch.testing.assert_close(buf, ref_buffers[name], atol=1e-6, rtol=0, msg=name)


def test_a_shape_the_trace_cannot_follow_is_refused() -> None:
    traced = trace_model(_gpt2(), ["transformer.h.2"], _lm_inputs(2, 8))
    with pytest.raises(ConfigError, match=r"'input_ids' is \[4, 4\].*traced for \[2, 8\]"):
        traced.forward(_lm_inputs(4, 4))


def test_a_split_point_that_names_no_module_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"\['transformer.h.9'\] name no module"):
        trace_model(_gpt2(), ["transformer.h.9"], _lm_inputs())
