"""``comm.gather_objects``: payloads of different sizes arrive whole, in rank order, at dst."""

from __future__ import annotations

from typing import Any

import torch

from syncline import comm
from syncline.testing import run_ranks


def _gather_rank(rank: int, world: int) -> list[Any] | None:
    payload = {"rank": rank, "weights": torch.full((rank * 50 + 1,), float(rank))}
    return comm.gather_objects(payload, dst=1, what="test gather", timeout_s=30.0)


def test_gather_objects_of_different_sizes_to_a_nonzero_rank() -> None:
    results = run_ranks(_gather_rank, 3)
    assert results[0] is None and results[2] is None
    gathered = results[1]
    assert [g["rank"] for g in gathered] == [0, 1, 2]
    for rank, g in enumerate(gathered):
        assert torch.equal(g["weights"], torch.full((rank * 50 + 1,), float(rank)))
