"""Checkpoints: exact round trip, and any corruption is caught before torch.load."""

from __future__ import annotations

import pytest
import torch

from syncline.errors import CheckpointError
from syncline.train.checkpoint import load_checkpoint, save_checkpoint


def _state() -> dict:
    torch.manual_seed(0)
    return {"model": {"w": torch.randn(5, 3)}, "step": 7, "config": {"lr": 0.1}}


def test_round_trip_is_exact(tmp_path) -> None:
    path = save_checkpoint(tmp_path / "ck.pt", _state())
    got = load_checkpoint(path)
    assert got["step"] == 7 and got["config"] == {"lr": 0.1}
    assert torch.equal(got["model"]["w"], _state()["model"]["w"])
    assert [p.name for p in tmp_path.iterdir()] == ["ck.pt"]  # no temporary left behind


def test_overwrite_replaces_whole_file(tmp_path) -> None:
    save_checkpoint(tmp_path / "ck.pt", {"step": 1, "pad": torch.zeros(1000)})
    save_checkpoint(tmp_path / "ck.pt", {"step": 2})
    assert load_checkpoint(tmp_path / "ck.pt")["step"] == 2


@pytest.mark.parametrize("damage", ["flip", "truncate", "header"])
def test_corruption_is_detected(tmp_path, damage) -> None:
    path = save_checkpoint(tmp_path / "ck.pt", _state())
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-20] ^= 0xFF
    elif damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[:4] = b"XXXX"
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError):
        load_checkpoint(path)


def test_missing_file(tmp_path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope.pt")
