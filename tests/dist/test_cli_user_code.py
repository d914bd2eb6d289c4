"""`syncline train` on your own model and data, as a user runs it: from the folder holding a
factory module that the test writes, on real processes (the command's validation in this
process, run from that folder; the workers' code on forked ranks started from it, as
torchrun starts them: :mod:`tests.zoo.train`).

Two runs cover the paths: the factory's model (no ``nn.Sequential``) on a text folder with
data parallelism (2 ranks), and a factory returning ``(model, loss)`` on an image folder as
a 2-stage pipeline cut at a split point (the model traced and called by its argument name).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from syncline.train.checkpoint import load_checkpoint
from tests.zoo.train import cli, train
from tests.zoo.user_code import MODULE, write_image_folder, write_module, write_text_folder

COMMON = ["--batch-size", "8", "--log-every", "2", "--eval-every", "4", "--warmup-steps", "0"]
COMMON += ["--sample-tokens", "0"]  # a test that wants the sample asks again, later


def _train(cwd: Path, run: str, *args: str) -> tuple[dict, list[dict]]:
    # the user's module is found in cwd, by the command and by every rank
    train(*COMMON, "--run-dir", run, *args, cwd=cwd)
    records = [json.loads(line) for line in (cwd / run / "metrics.jsonl").read_text().splitlines()]
    return json.loads((cwd / run / "summary.json").read_text()), records


@pytest.fixture
def user_dir(tmp_path: Path) -> Path:
    write_module(tmp_path)
    return tmp_path


def test_factory_model_on_a_text_folder_with_data_parallelism(user_dir) -> None:
    corpus = write_text_folder(user_dir / "corpus")
    summary, records = _train(
        user_dir, "dp", "--model", f"{MODULE}:TinyLM", "--model-option", "width=32",
        "--data", "text:corpus", "--seq-len", "16", "--steps", "9", "--lr", "0.02",
    )  # fmt: skip
    assert summary["model"] == f"{MODULE}:TinyLM" and summary["data"] == "text:corpus"
    assert summary["world_size"] == 2 and summary["final_loss"] < summary["first_loss"]
    validated = [r for r in records if r.get("val_loss") is not None]
    assert [r["step"] for r in validated] == [0, 4, 8]
    assert validated[-1]["val_loss"] < validated[0]["val_loss"]
    assert validated[0]["val_ppl"] > 1  # a language model: 16 tokens per sample
    assert records[0]["tokens_per_s"] == pytest.approx(16 * records[0]["samples_per_s"])
    state = load_checkpoint(user_dir / "dp" / "checkpoint.pt")["model"]
    assert state["pos"].shape == (16, 32) and state["head.weight"].shape == (256, 32)
    assert corpus.is_dir()


def test_factory_pair_on_an_image_folder_as_a_two_stage_pipeline(user_dir) -> None:
    write_image_folder(user_dir / "pics")
    summary, records = _train(
        user_dir, "pp", "--model", f"{MODULE}:conv_net", "--data", "images:pics",
        "--val-fraction", "0.25", "--pipeline-stages", "2", "--split-points", "body",
        "--microbatches", "2", "--steps", "8", "--lr", "0.03",
    )  # fmt: skip
    assert summary["data"] == "images:pics" and summary["split_points"] == ["body"]
    assert summary["pipeline_stages"] == 2 and summary["balance"] is None
    assert all(r["loss"] > 10 for r in records)  # the factory's own loss: cross-entropy + 10
    assert summary["final_loss"] < summary["first_loss"]
    assert any(r.get("val_loss") is not None for r in records)
    state = load_checkpoint(user_dir / "pp" / "checkpoint.pt")["model"]
    assert set(state) == {"stem.0.weight", "stem.0.bias", "body.2.weight", "body.2.bias"}
    assert state["body.2.weight"].shape == (3, 32) and torch.isfinite(state["stem.0.weight"]).all()


def _tokenizer(folder: Path, corpus: Path) -> tuple[Path, int]:
    """A small BPE tokenizer trained on the corpus here (nothing downloaded), saved as the
    ``tokenizer.json`` a HuggingFace model ships with."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(  # GPT-2's way: all 256 bytes, then merges: > 256 ids
        vocab_size=320, special_tokens=["[UNK]"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train([str(p) for p in sorted(corpus.rglob("*")) if p.is_file()], trainer)
    path = folder / "tokenizer.json"
    tok.save(str(path))
    return path, tok.get_vocab_size()


def test_tokenizer_level_text_trains_and_its_sample_reads_as_text(user_dir) -> None:
    """``--data tokens:TOKENIZER:PATH``: the built-in GPT on BPE ids; a vocabulary smaller
    than the tokenizer's is refused before launch, naming the option that fixes it."""
    corpus = write_text_folder(user_dir / "corpus")
    tok, vocab = _tokenizer(user_dir, corpus)
    data = f"tokens:{tok.name}:corpus"
    small = cli("train", "--data", data, "--steps", "1", cwd=user_dir)
    assert small.returncode == 2, small.stderr[-2000:]
    assert f"--model-option vocab_size={vocab}" in small.stderr
    summary, records = _train(
        user_dir, "bpe", "--data", data, "--model-option", f"vocab_size={vocab}",
        "--n-layer", "1", "--n-embd", "32", "--seq-len", "16", "--steps", "9", "--lr", "0.01",
        "--sample-tokens", "12",
    )  # fmt: skip
    assert summary["data"] == data and summary["final_loss"] < summary["first_loss"]
    validated = [r["val_loss"] for r in records if r.get("val_loss") is not None]
    assert validated[-1] < validated[0]
    assert vocab > 256  # so the built-in GPT's default (bytes) was too small
    sample = (user_dir / "bpe" / "sample.txt").read_text()
    assert sample.strip() and "\u0120" not in sample  # decoded text, not BPE symbols
