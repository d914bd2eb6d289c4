"""Standard-library corpus and the next-byte dataset."""

from __future__ import annotations

import sysconfig
import textwrap
from pathlib import Path

import pytest
import torch

from syncline.data import ByteDataset, stdlib_corpus, stdlib_files
from syncline.errors import ConfigError
from tests.zoo.fresh import run_python

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def test_corpus_is_deterministic_and_has_the_requested_length() -> None:
    a = stdlib_corpus(200_000)
    assert len(a) == 200_000
    assert a == stdlib_corpus(200_000)
    assert stdlib_corpus(1000) == a[:1000]


def test_corpus_is_the_stdlib_files_concatenated() -> None:
    files = stdlib_files()
    assert len(files) > 100
    assert files == stdlib_files()
    for path in files:
        rel = path.relative_to(STDLIB)  # raises if outside the standard library
        assert path.suffix == ".py"
        assert not {"site-packages", "dist-packages", "__pycache__"} & set(rel.parts)
        assert not {"test", "tests", "idle_test"} & set(rel.parts[:-1])
    corpus = stdlib_corpus(300_000)
    expected = b"".join(p.read_bytes() for p in files[:200])[:300_000]
    assert len(expected) == 300_000  # the first 200 files are enough to cover it
    assert corpus == expected


def test_walk_is_sorted_top_down() -> None:
    files = stdlib_files()
    # the root's own modules come first, in name order
    top = [p for p in files if p.parent == STDLIB]
    assert files[: len(top)] == top
    assert [p.name for p in top] == sorted(p.name for p in top)
    assert top[0].name == "__future__.py"


def test_tests_are_optional() -> None:
    with_tests = stdlib_files(include_tests=True)
    without = stdlib_files()
    assert set(without) <= set(with_tests)
    if (STDLIB / "test").is_dir():  # some distributions ship the stdlib without its tests
        assert any(p.parent.name == "test" for p in with_tests)


def test_whole_library_when_max_bytes_exceeds_it() -> None:
    files = stdlib_files()
    total = sum(p.stat().st_size for p in files)
    assert len(stdlib_corpus(10 * total)) == total


@pytest.mark.parametrize("bad", [0, -5, 1.5, True])
def test_corpus_rejects_bad_max_bytes(bad: object) -> None:
    with pytest.raises(ConfigError, match=f"max_bytes={bad!r}"):
        stdlib_corpus(bad)  # type: ignore[arg-type]


def test_import_does_no_work() -> None:
    code = textwrap.dedent(
        f"""
        import os, sys
        walked = []
        sys.addaudithook(
            lambda event, args: walked.append(args[0])
            if event == "os.scandir" and os.fspath(args[0]) == {str(STDLIB)!r} else None
        )
        import syncline.data, syncline.models
        assert not walked, walked
        assert "sklearn" not in sys.modules
        syncline.data.stdlib_files()
        assert walked  # the probe does see a walk
        """
    )
    run_python(code)


def test_pairs_are_shifted_windows() -> None:
    data = bytes(range(50)) * 3
    ds = ByteDataset(data, block_size=8)
    assert len(ds) == len(data) - 8
    idx = torch.tensor([0, 5, len(ds) - 1, 5])
    x, y = ds.get(idx)
    assert x.dtype == y.dtype == torch.long
    assert x.shape == y.shape == (4, 8)
    for row, i in enumerate(idx.tolist()):
        assert bytes(x[row].tolist()) == data[i : i + 8]
        assert bytes(y[row].tolist()) == data[i + 1 : i + 9]
    x0, y0 = ds[-1]
    assert torch.equal(x0, x[2]) and torch.equal(y0, y[2])
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_tensor_input_keeps_token_ids() -> None:
    tokens = torch.arange(1000, 1020)
    x, y = ByteDataset(tokens, block_size=4).get(torch.tensor([3]))
    assert x.tolist() == [[1003, 1004, 1005, 1006]]
    assert y.tolist() == [[1004, 1005, 1006, 1007]]


@pytest.mark.parametrize(
    ("data", "block_size", "message"),
    [
        (b"abcd", 0, "block_size=0"),
        (b"abcd", 4, "data has 4 tokens for block_size=4"),
        (b"", 1, "data has 0 tokens"),
        (torch.zeros(10), 2, "dtype torch.float32"),
        (torch.zeros(2, 5, dtype=torch.long), 2, r"shape \(2, 5\)"),
        ("text", 2, "type str"),
    ],
)
def test_bad_dataset_arguments(data: object, block_size: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ByteDataset(data, block_size)  # type: ignore[arg-type]


def test_split_cuts_the_stream() -> None:
    data = bytes(range(100))
    train, val = ByteDataset(data, block_size=4).split(0.2)
    assert bytes(train.data.tolist()) == data[:80]
    assert bytes(val.data.tolist()) == data[80:]
    assert (len(train), len(val)) == (76, 16)
    assert val.block_size == 4


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.5, 0.01, 0.99])
def test_split_rejects_bad_fractions(fraction: float) -> None:
    with pytest.raises(ConfigError, match=f"val_fraction={fraction}"):
        ByteDataset(bytes(100), block_size=4).split(fraction)
