"""Models built on the meta device, materialised layer by layer (issue 13).

Layer i gets the same values however the model is cut (a pipeline stage materialises only
its own layers, in any order, with the caller's random state untouched), the one-process
``materialize`` gives the same full model, and an initialiser that leaves a tensor unset is
refused rather than training on uninitialised memory.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from syncline.errors import ConfigError
from syncline.models import GPTConfig, build_gpt, gpt_layer_init, materialize, materialize_layers
from syncline.partition import stage_bounds

CFG = GPTConfig(n_layer=4, n_embd=32, n_head=2, block_size=16)


def _meta_gpt() -> nn.Sequential:
    with torch.device("meta"):
        return build_gpt(CFG)


@pytest.mark.parametrize("split", [[6], [3, 3], [1, 2, 2, 1], [2, 1, 1, 2]])
def test_each_layer_gets_the_same_values_whatever_the_split(split) -> None:
    whole = materialize(_meta_gpt(), seed=7, init=gpt_layer_init(CFG))
    model = _meta_gpt()
    torch.manual_seed(123)
    before = torch.rand(3)
    for lo, hi in reversed(stage_bounds(split)):  # stages in any order, each on its own
        layers = [(i, model[i]) for i in range(lo, hi)]
        materialize_layers(layers, device=torch.device("cpu"), seed=7, init=gpt_layer_init(CFG))
    torch.manual_seed(123)
    assert torch.equal(torch.rand(3), before)  # the caller's random state is untouched
    got, want = model.state_dict(), whole.state_dict()
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_initialisation_follows_the_seed_and_the_models_own_rule() -> None:
    a = materialize(_meta_gpt(), seed=0, init=gpt_layer_init(CFG))
    b = materialize(_meta_gpt(), seed=1, init=gpt_layer_init(CFG))
    assert not torch.equal(a[1].attn.c_attn.weight, b[1].attn.c_attn.weight)
    # nanoGPT's init: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layer)
    assert a[1].attn.c_attn.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert a[1].attn.c_proj.weight.std().item() == pytest.approx(0.02 / 8**0.5, rel=0.15)
    assert torch.equal(a[1].ln_1.weight, torch.ones(32))
    # two blocks are not copies of each other (each layer has its own seed)
    assert not torch.equal(a[1].mlp.c_fc.weight, a[2].mlp.c_fc.weight)


class _WithMask(nn.Module):
    """A layer with a buffer its ``reset_parameters`` does not set."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def test_an_initialiser_that_leaves_a_tensor_unset_is_refused() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), _WithMask())
    with pytest.raises(ConfigError, match=r"layer 1 \(_WithMask\).*\['scale'\] unset"):
        materialize(model)

    def init(index: int, layer: nn.Module) -> None:
        for m in layer.modules():
            if isinstance(m, nn.Linear):
                m.reset_parameters()
            if isinstance(m, _WithMask):
                m.scale.fill_(1.0)

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), _WithMask())
    materialize(model, init=init)
    assert torch.equal(model[1].scale, torch.ones(4))


def test_a_layer_half_on_the_meta_device_is_refused() -> None:
    layer = nn.Linear(4, 4)
    layer.bias = nn.Parameter(torch.empty(4, device="meta"))
    with pytest.raises(ConfigError, match="both on the meta device and off it"):
        materialize(nn.Sequential(layer))


def test_layers_built_for_real_keep_their_values() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    before = model[0].weight.clone()
    materialize(model, seed=5)
    assert torch.equal(model[0].weight, before)


def test_a_model_split_at_named_modules_gets_the_same_weights_at_any_split() -> None:
    """Module-by-module materialisation (seeded by name) of a meta-built HuggingFace GPT-2:
    the stages of two different splits hold exactly the one-process model's values, the
    model given stays on the meta device, HF's own init rules apply (GPT-2's residual
    projections scaled by 1/sqrt(2 n_layer)), and the traced stages compute as the model."""
    transformers = pytest.importorskip("transformers")
    from syncline.models.meta_modules import materialize_modules, materialize_named
    from syncline.pipeline.trace import retarget, trace_model

    cfg = transformers.GPT2Config(
        n_layer=4, n_embd=32, n_head=2, vocab_size=64, n_positions=16, use_cache=False,
        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip

    def meta_model() -> torch.nn.Module:
        with torch.device("meta"):
            return transformers.GPT2LMHeadModel(cfg)

    ref = meta_model()
    materialize_modules(ref, seed=5, init=lambda _, m: ref._init_weights(m))
    want = ref.state_dict()
    assert ref.lm_head.weight is ref.transformer.wte.weight  # still tied
    proj, attn = (
        want["transformer.h.1.attn.c_proj.weight"],
        want["transformer.h.1.attn.c_attn.weight"],
    )
    assert abs(float(proj.std()) - 0.02 / 8**0.5) < 0.002 and abs(float(attn.std()) - 0.02) < 0.002
    ids = torch.randint(0, 64, (2, 8))
    for points in (["transformer.h.1"], ["transformer.h.2", "transformer.h.3"]):
        model = meta_model()
        traced = trace_model(model, points, {"input_ids": ids.to("meta")})
        for s, stage in enumerate(traced.stages):
            init = model._init_weights
            materialize_named(
                stage,
                model,
                traced.canonical[s],
                device=torch.device("cpu"),
                seed=5,
                init=lambda _, m, f=init: f(m),
            )
            retarget(stage, torch.device("cpu"))
            for name, value in stage.state_dict().items():
                assert torch.equal(value, want[traced.canonical[s].get(name, name)]), (points, name)
        assert all(t.is_meta for t in model.parameters())
        torch.testing.assert_close(traced.forward({"input_ids": ids}), ref(input_ids=ids).logits)
    with pytest.raises(ConfigError, match=r"left .* unset"):
        materialize_modules(meta_model(), init=lambda _, m: None)


def _no_cuda_rng(monkeypatch) -> None:
    """Make every CUDA generator call fail: initialisation must draw on the CPU only."""

    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("the initialisation touched a CUDA generator")

    for name in ("manual_seed", "manual_seed_all", "get_rng_state", "set_rng_state", "seed"):
        monkeypatch.setattr(torch.cuda, name, refuse)


def test_initialisers_draw_on_the_cpu_whatever_the_device(monkeypatch) -> None:
    """Issue 33: a stage materialised on another device (``meta`` stands in for CUDA, whose
    generator draws other numbers than the CPU's from the same seed) is initialised on the
    CPU from the CPU generator and only then copied there, so its values are those of the
    one-process CPU model; no CUDA generator is seeded or read."""
    _no_cuda_rng(monkeypatch)
    drawn: dict[str, torch.Tensor] = {}
    rule = gpt_layer_init(CFG)

    def init(index: int, layer: nn.Module) -> None:
        rule(index, layer)
        for name, t in layer.state_dict().items():
            assert t.device.type == "cpu", (index, name, t.device)
            drawn[f"{index}.{name}"] = t.clone()

    model = _meta_gpt()
    materialize_layers(list(enumerate(model))[2:], device=torch.device("meta"), seed=7, init=init)
    assert all(t.is_meta for t in model.parameters())  # copied to its device; stage 0 untouched
    want = materialize(_meta_gpt(), seed=7, init=gpt_layer_init(CFG)).state_dict()
    assert set(drawn) == {k for k in want if int(k.split(".")[0]) >= 2}
    for key, value in drawn.items():
        assert torch.equal(value, want[key]), key


def test_weights_tied_across_layers_stay_tied_and_follow_the_eager_model() -> None:
    cfg = GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16, tie_weights=True)
    with torch.device("meta"):
        meta = build_gpt(cfg)
    model = materialize(meta, seed=3, init=gpt_layer_init(cfg))
    assert model[-1].lm_head.weight is model[0].wte.weight
    assert not torch.isnan(model[0].wte.weight).any()
    with torch.device("meta"):
        meta = build_gpt(cfg)
    materialize_layers(
        list(enumerate(meta)), device=torch.device("meta"), seed=3, init=gpt_layer_init(cfg)
    )
    assert meta[-1].lm_head.weight is meta[0].wte.weight  # also on another device


def test_modules_split_by_name_draw_on_the_cpu_whatever_the_device(monkeypatch) -> None:
    """As above, for models materialised module by module (split at named modules)."""
    from syncline.models.meta_modules import materialize_modules

    _no_cuda_rng(monkeypatch)
    drawn: dict[str, torch.Tensor] = {}

    def init(name: str, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            assert module.weight.device.type == "cpu", name
            module.reset_parameters()
            drawn[name] = module.weight.clone()

    def meta_model() -> nn.Module:
        with torch.device("meta"):
            return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

    elsewhere = materialize_modules(meta_model(), device="meta", seed=2, init=init)
    assert all(t.is_meta for t in elsewhere.parameters()) and set(drawn) == {"0", "2"}
    there = dict(drawn)
    on_cpu = materialize_modules(meta_model(), device="cpu", seed=2, init=init)
    assert torch.equal(on_cpu[0].weight, there["0"]) and torch.equal(on_cpu[2].weight, there["2"])
