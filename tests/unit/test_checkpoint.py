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


class _RunsCode:
    """What a malicious payload pickles: unpickling it would call ``os.system``."""

    def __reduce__(self):
        import os

        return (os.system, ("touch PWNED_BY_CHECKPOINT",))


def test_payload_that_runs_code_is_refused_and_never_runs(tmp_path, monkeypatch) -> None:
    """A well-formed file (right magic, matching digest) whose payload pickles ``os.system``:
    refused with CheckpointError naming the file, and the command never ran."""
    import hashlib
    import io

    from syncline.train.checkpoint import MAGIC

    monkeypatch.chdir(tmp_path)
    buf = io.BytesIO()
    torch.save({"model": {}, "evil": _RunsCode()}, buf)
    payload = buf.getvalue()
    path = tmp_path / "evil.pt"
    path.write_bytes(MAGIC + hashlib.sha256(payload).digest() + payload)
    with pytest.raises(CheckpointError, match=r"evil\.pt") as info:
        load_checkpoint(path)
    assert "nothing in it was run" in str(info.value)
    assert not (tmp_path / "PWNED_BY_CHECKPOINT").exists()
