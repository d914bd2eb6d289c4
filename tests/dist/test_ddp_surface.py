"""DistributedDataParallel's whole surface, as scripts use it: every name torch's DDP gives a
meaning to is implemented by DataParallel or refused with a clear error, never accepted and
ignored; ``require_backward_grad_sync`` accumulates gradients as DDP does."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from syncline import DataParallel
from syncline.dp.ddp_surface import ddp_attribute_names
from syncline.testing import run_ranks

#: what DataParallel implements with DDP's meaning (a script may read, set or call them)
IMPLEMENTED = {
    "module",
    "no_sync",
    "process_group",
    "require_backward_grad_sync",
    "require_forward_param_sync",
    "join",  # uneven inputs, as DDP (tests/dist/test_ddp_join.py)
    "join_hook",  # torch's Joinable protocol, as DDP's
    "join_device",
    "join_process_group",
    "register_comm_hook",  # refuses when called: compression= instead
}


def _surface_rank(rank: int, world: int) -> dict[str, list[str]]:
    torch.manual_seed(0)
    dp = DataParallel(nn.Linear(4, 2))
    implemented, refused, silent = [], [], []
    for name in sorted(ddp_attribute_names()):
        try:
            getattr(dp, name)
            implemented.append(name)
            continue
        except AttributeError as exc:
            read = str(exc)
        try:
            setattr(dp, name, object())
        except AttributeError as exc:
            if "DistributedDataParallel" in read and "DistributedDataParallel" in str(exc):
                refused.append(name)
                continue
        silent.append(name)
    from torch.distributed.algorithms.join import Joinable

    joinable = isinstance(dp, Joinable) and dp.join_process_group is dist.group.WORLD
    return {"implemented": implemented, "refused": refused, "silent": silent, "joinable": joinable}


def test_every_ddp_name_is_implemented_or_refused_never_ignored() -> None:
    names = ddp_attribute_names()
    assert {"static_graph", "gradient_as_bucket_view", "require_backward_grad_sync"} <= names
    got = run_ranks(_surface_rank, 1)[0]
    assert got["joinable"]
    assert got["silent"] == []
    assert set(got["implemented"]) >= IMPLEMENTED
    assert "static_graph" in got["refused"] and "_set_static_graph" in got["refused"]
    assert set(got["implemented"]) | set(got["refused"]) == names


class _Counted:
    """Counts the collectives issued (a spy around torch.distributed's own functions)."""

    def __init__(self) -> None:
        self.calls = 0
        self._saved = {}

    def __enter__(self) -> _Counted:
        for name in ("all_reduce", "all_gather", "broadcast", "reduce_scatter_tensor"):
            real = getattr(dist, name)
            self._saved[name] = real

            def spy(*args, _real=real, **kwargs):
                self.calls += 1
                return _real(*args, **kwargs)

            setattr(dist, name, spy)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, real in self._saved.items():
            setattr(dist, name, real)


def _accumulate_rank(rank: int, world: int, kind: str) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        wrapped = DDP(model) if kind == "ddp" else DataParallel(model, bucket_cap_mb=25)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(10 + rank)
    counts = []
    for _ in range(3):  # optimizer steps, 2 micro-steps each, as nanoGPT's loop does
        for micro in range(2):
            wrapped.require_backward_grad_sync = micro == 1
            x, y = torch.randn(4, 6, generator=gen), torch.randn(4, 3, generator=gen)
            with _Counted() as counted:
                nn.functional.mse_loss(wrapped(x), y).backward()
            counts.append(counted.calls)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"weights": [p.detach().clone() for p in model.parameters()], "counts": counts}


def test_require_backward_grad_sync_accumulates_like_ddp_with_one_reduction_per_step() -> None:
    ours = run_ranks(_accumulate_rank, 2, "syncline")
    ddp = run_ranks(_accumulate_rank, 2, "ddp")
    for rank in range(2):
        for a, b in zip(ours[rank]["weights"], ddp[rank]["weights"], strict=True):
            assert torch.equal(a, b)
        counts = ours[rank]["counts"]
        assert counts[0::2] == [0, 0, 0]  # the flag False: the backward reduced nothing
        assert all(c >= 1 for c in counts[1::2])  # the flag True: the step's reduction


def _sparse_only_rank(rank: int, world: int, kind: str) -> torch.Tensor:
    torch.manual_seed(0)
    model = nn.EmbeddingBag(10, 4, sparse=True)  # its only parameter has sparse gradients
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        wrapped = DDP(model) if kind == "ddp" else DataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        wrapped(torch.tensor([[rank, step, 3], [7, rank + 4, step]])).pow(2).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model.weight.detach().clone()


def test_a_model_with_only_sparse_parameters_trains_as_under_ddp() -> None:
    ours, ddp = run_ranks(_sparse_only_rank, 2, "syncline"), run_ranks(_sparse_only_rank, 2, "ddp")
    for a, b in zip(ours, ddp, strict=True):
        assert torch.equal(a, b)


def _pickled_rank(rank: int, world: int, kind: str, how: str) -> list[torch.Tensor]:
    import copy
    import io

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        wrapped = DDP(model) if kind == "ddp" else DataParallel(model, bucket_cap_mb=25)
    gen = torch.Generator().manual_seed(10 + rank)

    def train(w: nn.Module, steps: int) -> None:
        opt = torch.optim.SGD(w.parameters(), lr=0.1)
        for _ in range(steps):
            x, y = torch.randn(4, 6, generator=gen), torch.randn(4, 3, generator=gen)
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(w(x), y).backward()
            opt.step()

    train(wrapped, 2)
    if how == "save":  # torch.save of the wrapper mid-training, loaded, trained on
        buf = io.BytesIO()
        torch.save(wrapped, buf)
        buf.seek(0)
        again = torch.load(buf, weights_only=False)
    else:
        again = copy.deepcopy(wrapped)
    train(again, 3)
    return [p.detach().clone() for p in again.parameters()]


def test_a_pickled_or_copied_wrapper_trains_on_as_ddps_does() -> None:
    for how in ("save", "deepcopy"):
        ours = run_ranks(_pickled_rank, 2, "syncline", how)
        ddp = run_ranks(_pickled_rank, 2, "ddp", how)
        for a, b in zip(ours, ddp, strict=True):
            for x, y in zip(a, b, strict=True):
                assert torch.equal(x, y), how
        assert not torch.equal(ours[0][0], ours[0][0] * 0)  # trained, not empty
