"""``syncline train`` on HuggingFace models from their default configs (only the size shrunk),
as a user runs it: a factory module naming the model and its loss, the built-in text data
or the user's own masked-LM data set, data parallelism and a 2-stage pipeline cut at a split
point (Llama keeps ``use_cache=True`` as built; the tracer is given it without its cache)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from syncline.train.checkpoint import load_checkpoint
from tests.zoo.train import train
from tests.zoo.user_code import write_text_folder

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # each rank imports transformers

MODULE = "user_hf"
SOURCE = '''
"""A user's HuggingFace models for syncline train."""

import torch
import torch.nn.functional as F
import transformers

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
             intermediate_size=64, vocab_size=256)


def _logits(out):
    return out if isinstance(out, torch.Tensor) else out.logits


def causal_loss(out, target):
    return F.cross_entropy(_logits(out).flatten(0, 1), target.flatten())


def llama(seq_len):
    config = transformers.LlamaConfig(**SMALL, num_key_value_heads=2,
                                      max_position_embeddings=seq_len)
    return transformers.LlamaForCausalLM(config), causal_loss


def bert(seq_len):
    config = transformers.BertConfig(**SMALL, max_position_embeddings=seq_len)
    return transformers.BertForMaskedLM(config), causal_loss


def masked(seq_len, seed):
    """BERT's objective on random tokens: ~15 % replaced by [MASK] (id 1), -100 elsewhere."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(64):
        ids = torch.randint(2, 256, (seq_len,), generator=g)
        chosen = torch.rand(seq_len, generator=g) < 0.15
        chosen[0] = True
        out.append((ids.masked_fill(chosen, 1), ids.masked_fill(~chosen, -100)))
    return out
'''
COMMON = ["--batch-size", "8", "--log-every", "1", "--eval-every", "0", "--warmup-steps", "0"]
COMMON += ["--seq-len", "16", "--steps", "6", "--lr", "0.01"]


@pytest.fixture
def user_dir(tmp_path: Path) -> Path:
    (tmp_path / f"{MODULE}.py").write_text(SOURCE)
    write_text_folder(tmp_path / "corpus")
    return tmp_path


def _train(cwd: Path, run: str, *args: str) -> dict:
    train(*COMMON, "--run-dir", run, *args, cwd=cwd)
    return json.loads((cwd / run / "summary.json").read_text())


@pytest.mark.parametrize(
    ("model", "data", "split"),
    [
        ("llama", "text:corpus", "model.layers.1"),
        ("bert", f"{MODULE}:masked", "bert.encoder.layer.1"),
    ],
)
def test_a_default_config_model_trains_data_parallel_and_as_a_pipeline(
    user_dir: Path, model: str, data: str, split: str
) -> None:
    spec = ["--model", f"{MODULE}:{model}", "--data", data]
    dp = _train(user_dir, f"{model}-dp", *spec)
    pp = _train(
        user_dir, f"{model}-pp", *spec, "--pipeline-stages", "2", "--split-points", split,
        "--microbatches", "2",
    )  # fmt: skip
    for summary in (dp, pp):
        assert summary["final_loss"] < summary["first_loss"], summary
    assert pp["split_points"] == [split] and pp["pipeline_stages"] == 2
    # the whole model's state_dict, whatever the split (BERT's tied decoder bias included)
    for run in (f"{model}-dp", f"{model}-pp"):
        state = load_checkpoint(user_dir / run / "checkpoint.pt")["model"]
        built = _factory(user_dir, model)
        assert list(state) == list(built.state_dict())
        built.load_state_dict(state)  # strict


def _factory(cwd: Path, model: str) -> torch.nn.Module:
    spec = importlib.util.spec_from_file_location(MODULE, cwd / f"{MODULE}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, model)(16)[0]
