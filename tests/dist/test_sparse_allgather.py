"""Sparse allreduce over dense allgathers (the NCCL path) gives gloo's own result bit for bit.

Stock NCCL has no sparse ``all_reduce``; ``comm.allreduce_sparse`` then sums the ranks'
indices and values itself. Here, on gloo, the same tensors are reduced both ways and compared:
indices, values (exactly: the parts are concatenated in rank order and coalesced as gloo
does) and the coalesced flag. DataParallel's sparse gradients then take that path with the
backend name forced off gloo and must match a run on gloo's own sparse allreduce.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from syncline import DataParallel, comm
from syncline.comm import groups
from syncline.testing import run_ranks


def _rank_tensor(rank: int, case: str) -> torch.Tensor:
    """Overlapping, duplicated and (on rank 1) empty entries; 2-d values."""
    gen = torch.Generator().manual_seed(100 + rank)
    if case == "empty" or (case == "mixed" and rank == 1):
        idx = torch.empty((1, 0), dtype=torch.long)
    else:
        idx = torch.randint(0, 6, (1, 5 + 3 * rank), generator=gen)  # duplicates inside
    vals = torch.randn(idx.shape[1], 3, generator=gen, dtype=torch.float32)
    return torch.sparse_coo_tensor(idx, vals, (6, 3), check_invariants=True)


def _both_ways(rank: int, world: int, case: str) -> list[Any]:
    out = []
    for by_allgather in (False, True):
        t = _rank_tensor(rank, case)
        comm.allreduce_sparse(t, what="test", timeout_s=30.0, by_allgather=by_allgather).wait()
        out.append((t._indices().clone(), t._values().clone(), t.is_coalesced()))
    return out


@pytest.mark.parametrize("case", ["mixed", "empty"])
def test_allgather_path_equals_gloo_sparse_allreduce(case: str) -> None:
    results = run_ranks(_both_ways, 3, case)
    for rank, ((gi, gv, gc), (ai, av, ac)) in enumerate(results):
        assert torch.equal(ai, gi), f"rank {rank}: indices differ"
        assert torch.equal(av, gv), f"rank {rank}: values differ (not bit-exact)"
        assert ac == gc, f"rank {rank}: coalesced {ac} != gloo's {gc}"
    assert torch.equal(results[0][1][1], results[2][1][1])  # every rank holds the same sum
    if case == "mixed":
        dense = sum(_rank_tensor(r, case).to_dense() for r in range(3))
        got = torch.sparse_coo_tensor(
            results[0][1][0], results[0][1][1], (6, 3), check_invariants=True
        ).to_dense()
        assert torch.allclose(got, dense, rtol=0, atol=1e-6)


class _Sparse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(10, 3, sparse=True)
        self.head = nn.Linear(3, 2)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.table(idx))


def _no_sparse_all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """``dist.all_reduce`` as stock NCCL has it: no sparse tensors."""
    if tensor.is_sparse:
        raise RuntimeError("NCCL does not support all_reduce with sparse tensors")
    return _ALL_REDUCE(tensor, *args, **kwargs)


_ALL_REDUCE = dist.all_reduce


def _train(rank: int, world: int, force_allgather: bool) -> dict[str, torch.Tensor]:
    if force_allgather:  # as under NCCL: every backend but gloo takes the allgather path
        groups.backend_name = lambda group=None: "not-gloo"  # type: ignore[assignment]
        dist.all_reduce = _no_sparse_all_reduce
    torch.manual_seed(0)
    model = _Sparse()
    dp = DataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out: dict[str, torch.Tensor] = {}
    for step in range(2):
        idx = torch.tensor([[rank, rank + 2 + step, 1], [3, 3, rank * 3]])
        dp(idx).sum().backward()
        grad = model.table.weight.grad
        assert grad is not None and grad.is_sparse
        out[f"grad{step}"] = grad.to_dense().clone()
        opt.step()
        opt.zero_grad()
    out["weight"] = model.table.weight.detach().clone()
    return out


def test_data_parallel_sparse_gradients_off_gloo_match_gloo() -> None:
    gloo = run_ranks(_train, 2, False)
    forced = run_ranks(_train, 2, True)
    for rank in range(2):
        for key in gloo[rank]:
            assert torch.equal(forced[rank][key], gloo[rank][key]), f"rank {rank} {key}"
