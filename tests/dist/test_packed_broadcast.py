"""``comm.PackedBroadcast``: the same tensors, mixed dtypes and layouts, sent round after round."""

from __future__ import annotations

import torch

from syncline import comm
from syncline.testing import run_ranks


def _tensors(rank: int) -> list[torch.Tensor]:
    base = torch.full((4, 3), float(rank))
    return [
        torch.full((5,), float(rank)),  # float32
        torch.tensor(rank, dtype=torch.int64),  # a 0-dim counter, as BatchNorm's
        base.t(),  # non-contiguous
        torch.full((2,), float(rank), dtype=torch.float64),
    ]


def _rounds_rank(rank: int, world: int) -> list[list[torch.Tensor]]:
    tensors = _tensors(rank)
    bcast = comm.PackedBroadcast(tensors, src=1, timeout_s=30.0)
    seen = []
    for round_ in range(3):
        if rank == 1:  # the source changes its tensors in place between rounds
            for t in tensors:
                t.add_(10 * (round_ + 1))
        pending = bcast.start(f"test round {round_}")
        if rank == 1:
            want = [t.clone() for t in tensors]
            for t in tensors:  # changed after start: receivers still get the snapshot
                t.add_(1000)
            pending.wait()
            for t, w in zip(tensors, want, strict=True):
                t.copy_(w)
        else:
            pending.wait()
        seen.append([t.clone() for t in tensors])
    return seen


def test_every_round_delivers_the_sources_snapshot() -> None:
    results = run_ranks(_rounds_rank, 3)
    for round_ in range(3):
        want = results[1][round_]
        assert int(want[1]) == 1 + sum(10 * (r + 1) for r in range(round_ + 1))
        for rank in (0, 2):
            got = results[rank][round_]
            for g, w in zip(got, want, strict=True):
                assert g.dtype == w.dtype and g.shape == w.shape
                assert torch.equal(g, w)
