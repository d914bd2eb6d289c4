"""Your own model and data (``--model package.module:factory``, ``--data text:PATH``,
``images:PATH``, ``package.module:factory``): built as documented, and every bad value stops
``syncline train`` before any process starts, in one line that names it."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from syncline.cli.main import main
from syncline.data.files import read_text
from syncline.data.heldout import holdout
from syncline.data.registry import build_dataset, data_spec
from syncline.errors import ConfigError
from syncline.models.user import default_loss
from syncline.train.common import build_model_for, loss_for
from syncline.train.config import TrainConfig
from tests.zoo.user_code import MODULE, write_image_folder, write_module, write_text_folder


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A folder with the user's module and data, importable as the current directory is
    in ``syncline train`` (sys.path and the imported module restored afterwards)."""
    root = tmp_path_factory.mktemp("user")
    write_module(root)
    write_text_folder(root / "corpus")
    write_image_folder(root / "pics")
    (root / "empty").mkdir()
    (root / "binary").mkdir()
    (root / "binary" / "x.bin").write_bytes(b"a\0b")
    (root / "tiny.txt").write_text("hello")
    (root / "noimages" / "cls").mkdir(parents=True)
    (root / "noimages" / "cls" / "a.txt").write_text("x")
    (root / "broken" / "cls").mkdir(parents=True)
    (root / "broken" / "cls" / "a.png").write_text("not a png")
    saved = list(sys.path)
    sys.path.insert(0, str(root))
    yield root
    sys.path[:] = saved
    sys.modules.pop(MODULE, None)


M = f"{MODULE}:TinyLM"
# (arguments after `syncline train`, with {d} the user's folder; what the one line says)
BAD_INPUT = [
    (["--model", "resnet"], "model='resnet' is unknown; valid: gpt, cnn, or your own factory"),
    (["--model", f"{MODULE}:"], "is not a factory reference; valid: 'package.module:function'"),
    (["--model", "no_such_module:f", "--data", "stdlib"], "cannot import module 'no_such_module'"),
    (["--model", f"{MODULE}:missing", "--data", "stdlib"], "has no attribute 'missing'; valid:"),
    (["--model", f"{MODULE}:not_a_model", "--data", "stdlib"], "valid: an nn.Module, or a pair"),
    (["--model", M, "--data", "stdlib", "--model-option", "depth=2"], "valid: seq_len, width"),
    (["--model", M], f"model='{M}' needs --data; valid: stdlib, digits, synthetic, text:PATH"),
    (["--model", M, "--data", "stdlib", "--pipeline-stages", "2"], "not an nn.Sequential"),
    (
        ["--model", M, "--data", "stdlib", "--pipeline-stages", "2", "--split-points", "nope"],
        "'nope' names no module of TinyLM; valid: names from model.named_modules(), e.g. embed",
    ),
    (["--pipeline-stages", "2", "--split-points", "x"], "the built-in models are cut by layers"),
    (["--data", "text:{d}/missing"], "no such file or folder"),
    (["--data", "text:{d}/empty"], "the folder holds no file"),
    (["--data", "text:{d}/binary"], "x.bin is not text (it holds NUL bytes)"),
    (["--data", "text:{d}/tiny.txt"], "holds 5 bytes"),
    (["--data", "text:"], "data='text:' needs its PATH"),
    (["--model", "cnn", "--data", "text:{d}/corpus"], "does not fit model 'cnn'"),
    (["--model", "cnn", "--data", "images:{d}/empty"], "has no class sub-folders"),
    (["--model", "cnn", "--data", "images:{d}/noimages"], "class folder 'cls' holds no image"),
    (["--model", "cnn", "--data", "images:{d}/broken"], "cannot read"),
    (["--data", "tokens:{d}/corpus"], "valid: tokens:TOKENIZER:PATH, a tokenizer.json file"),
    (["--data", "tokens:{d}/nope.json:{d}/corpus"], "tokenizer '"),
    (["--data", "tokens:{d}/tiny.txt:{d}/corpus"], "cannot read tokenizer"),
    (["--data", f"{MODULE}:not_pairs"], "are not (input, target) pairs"),
    (["--data", "txt:{d}/corpus"], "is unknown; valid: stdlib, digits, synthetic, text:PATH"),
    (["--data", "txt:corpus"], "no registered data set 'txt' and no module 'txt'"),
]


@pytest.mark.parametrize(("args", "match"), BAD_INPUT, ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_bad_model_or_data_is_one_line_and_exit_2(user_dir, capsys, args, match) -> None:
    run = user_dir / "runs" / "bad"
    argv = ["train", "--run-dir", str(run), *(a.format(d=user_dir) for a in args)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert match in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not run.exists()  # stopped before any work


def test_text_folder_is_its_files_in_sorted_order(user_dir) -> None:
    corpus = user_dir / "corpus"
    files = [corpus / "0.txt", corpus / "1.txt", corpus / "part" / "2.txt"]  # no .hidden.txt
    assert read_text(str(corpus)) == b"".join(p.read_bytes() for p in files)
    dataset, tokens = build_dataset(f"text:{corpus}", 16, 0)
    assert tokens == 16 and len(dataset) == sum(p.stat().st_size for p in files) - 16
    x, y = dataset.get(torch.tensor([0]))
    assert torch.equal(x[0, 1:], y[0, :-1])  # next-byte targets: the shifted LM loss


def test_image_folder_is_read_as_imagefolder(user_dir) -> None:
    dataset, tokens = build_dataset(f"images:{user_dir / 'pics'}", 64, 0)
    assert tokens == 1 and dataset.classes == ["blue", "green", "red"] and len(dataset) == 24
    x, y = dataset.get(torch.arange(24))
    assert x.shape == (24, 3, 10, 6) and x.dtype == torch.float32  # resized to the first
    assert x.min() >= 0 and x.max() <= 1 and y.tolist() == [c for c in range(3) for _ in range(8)]
    assert x[y == 2, 0].mean() > x[y == 2, 2].mean()  # red is red
    train, val = holdout(dataset, 0.25)
    assert val.labels.tolist() == [0, 0, 1, 1, 2, 2] and len(train) == 18  # every class


def test_data_factory_is_gathered_in_batches(user_dir) -> None:
    entry, argument = data_spec(f"{MODULE}:pairs")
    assert entry.name == "factory" and argument == f"{MODULE}:pairs"
    dataset, tokens = build_dataset(f"{MODULE}:pairs", 8, 3)
    x, y = dataset.get(torch.tensor([5, 0]))
    assert tokens == 1 and len(dataset) == 40 and x.shape == (2, 4) and y.tolist() == [1, 0]
    again, _ = build_dataset(f"{MODULE}:pairs", 8, 3)  # seed passed: the same samples
    assert torch.equal(again.get(torch.tensor([5]))[0], x[:1])


def test_factory_model_options_seq_len_and_losses(user_dir) -> None:
    cfg = TrainConfig(
        model=M, data="stdlib", seq_len=12, model_options={"width": "8"}, run_dir="unused"
    )
    assert cfg.model_options == {"width": 8}  # a command-line value read as a literal
    model = build_model_for(cfg)
    assert model.pos.shape == (12, 8)  # seq_len offered, because TinyLM takes it
    assert loss_for(cfg) is default_loss
    pair = TrainConfig(model=f"{MODULE}:conv_net", data="synthetic", run_dir="unused")
    logits, target = torch.zeros(2, 3), torch.tensor([0, 1])
    assert loss_for(pair)(logits, target).item() == pytest.approx(10 + torch.log(torch.tensor(3.0)))
    again = TrainConfig.from_dict(cfg.to_dict())
    assert again == cfg


class _HFOutput:  # what a HuggingFace model returns: logits under .logits
    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits


def test_default_loss_reads_classes_tokens_and_regression() -> None:
    logits, classes = torch.randn(4, 5), torch.tensor([0, 1, 2, 3])
    want = torch.nn.functional.cross_entropy(logits, classes)
    assert torch.allclose(default_loss(logits, classes), want)
    assert torch.allclose(default_loss(_HFOutput(logits), classes), want)
    assert torch.allclose(default_loss((logits, None), classes), want)
    lm, tokens = torch.randn(2, 3, 7), torch.randint(0, 7, (2, 3))
    per_token = torch.nn.functional.cross_entropy(lm.reshape(6, 7), tokens.reshape(6))
    assert torch.allclose(default_loss(lm, tokens), per_token)
    assert default_loss(torch.ones(3, 1), torch.zeros(3)).item() == 1.0  # MSE
    with pytest.raises(TypeError, match="return \\(model, loss\\)"):
        default_loss({"x": 1}, classes)


def test_split_points_need_a_factory_and_the_stage_count() -> None:
    with pytest.raises(ConfigError, match="cut the model into 3 stages, the pipeline has 2"):
        TrainConfig.from_flat(model=M, data="stdlib", pipeline_stages=2, split_points=("a", "b"))
    # a pipeline cut at split points resumes (traced again on the batch it continues with)
    cfg = TrainConfig.from_flat(
        model=M, data="stdlib", pipeline_stages=2, split_points=("a",), max_restarts=1
    )
    assert cfg.pipeline.split_points == ("a",) and cfg.checkpoint.max_restarts == 1
