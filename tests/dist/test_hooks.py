"""syncline's compressors as DDP communication hooks, on 2 gloo ranks: torch's DDP with
``syncline.hooks`` trains to the same bits as syncline's DataParallel with the same
compressor, and a hook state saved and loaded into a new DDP continues to the same bits."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from syncline import DataParallel
from syncline.dp import build_compressor
from syncline.hooks import HookState, hook
from syncline.testing import run_ranks

#: 0.002 MiB: DDP (and DataParallel) cut the model below into two buckets once re-cut
CAP_MB = 0.002
STEPS = 5
SPECS = (
    "csc:0.25:chunk=16",
    "csc:0.1:chunk=8:warmup=2",
    "topk:0.1",
    "fp16",
    "bf16",
    "powersgd:2",
)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)


def _train(
    dp: nn.Module,
    model: nn.Module,
    rank: int,
    steps: range,
    opt: torch.optim.Optimizer,
    wire: list[int] | None = None,
    state: HookState | None = None,
) -> list[list[torch.Tensor]]:
    """SGD without momentum (CSC owns it); the parameters after every step (and the hook's
    bytes on the wire into ``wire``)."""
    out = []
    for step in steps:
        x, y = _batch(rank, step)
        F.mse_loss(dp(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append([p.detach().clone() for p in model.parameters()])
        if wire is not None and state is not None:
            wire.append(state.last_wire_bytes)
    return out


def _ddp(model: nn.Module, spec: str) -> tuple[nn.Module, HookState]:
    ddp = DDP(model, bucket_cap_mb=CAP_MB)
    state = HookState(build_compressor(spec), timeout_s=60.0)
    ddp.register_comm_hook(state, hook)
    return ddp, state


def _parity_rank(rank: int, world: int) -> dict[str, dict[str, object]]:
    del world
    out: dict[str, dict[str, object]] = {}
    for spec in SPECS:
        model = _model()
        ddp, state = _ddp(model, spec)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        hooked = _train(ddp, model, rank, range(STEPS), opt)
        ours = _model()
        dp = DataParallel(ours, bucket_cap_mb=CAP_MB, compression=build_compressor(spec))
        opt = torch.optim.SGD(ours.parameters(), lr=0.05)
        reference = _train(dp, ours, rank, range(STEPS), opt)
        out[spec] = {
            "hooked": hooked,
            "reference": reference,
            "buckets_reduced": state.buckets_reduced,
            "step": state.step,
            "hook_buckets": dict(state._buckets),
            "dp_buckets": {b.index: b.params for b in dp.bucket_plan.buckets},
            "wire": state.last_wire_bytes,
            "dp_wire": dp.last_stats.wire_bytes,
            "dense": dp.last_stats.dense_bytes,
        }
    return out


@pytest.fixture(scope="module")
def parity() -> list[dict[str, dict[str, object]]]:
    return run_ranks(_parity_rank, 2, timeout_s=240.0)


@pytest.mark.parametrize("spec", SPECS)
def test_ddp_with_a_syncline_hook_equals_data_parallel_bit_for_bit(parity, spec: str) -> None:
    for rank, results in enumerate(parity):
        got = results[spec]
        for step, (a, b) in enumerate(zip(got["hooked"], got["reference"], strict=True)):
            for i, (pa, pb) in enumerate(zip(a, b, strict=True)):
                assert torch.equal(pa, pb), (spec, rank, step, i, (pa - pb).abs().max())
        # the same buckets: DDP's re-cut ones are DataParallel's (parameter indices)
        assert got["hook_buckets"] == got["dp_buckets"], got
        assert len(got["dp_buckets"]) == 2
        # the first backward is one DDP bucket (reduced losslessly), then two per step
        assert got["buckets_reduced"] == 1 + 2 * (STEPS - 1)
        assert got["step"] == STEPS
        # the hook compressed as much as DataParallel did (same bytes on the wire)
        assert got["wire"] == got["dp_wire"]
        assert got["wire"] < got["dense"]
    assert all(
        torch.equal(a, b)
        for a, b in zip(parity[0][spec]["hooked"][-1], parity[1][spec]["hooked"][-1], strict=True)
    )


# -- checkpoints ----------------------------------------------------------------------------


def _resume_rank(rank: int, world: int, spec: str) -> dict[str, object]:
    del world
    model = _model()
    ddp, state = _ddp(model, spec)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    straight_wire: list[int] = []
    straight = _train(ddp, model, rank, range(6), opt, straight_wire, state)

    model = _model()
    ddp, state = _ddp(model, spec)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    _train(ddp, model, rank, range(3), opt)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "hook": state.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    del ddp, state, model

    model = _model()  # a new model, a new DDP (whose first backward is one bucket of all)
    model.load_state_dict(saved["model"])
    ddp, state = _ddp(model, spec)
    state.load_state_dict(saved["hook"])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    resumed_wire: list[int] = []
    resumed = _train(ddp, model, rank, range(3, 6), opt, resumed_wire, state)

    # a state saved from this model refuses another one, naming the shapes
    other = nn.Sequential(nn.Linear(8, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrong, wrong_state = _ddp(other, spec)
    wrong_state.load_state_dict(saved["hook"])
    try:
        wrong(torch.randn(2, 8)).sum().backward()
        refused = ""
    except Exception as exc:  # raised in the hook, surfaced by backward
        refused = str(exc)
    return {
        "straight": straight[3:],
        "resumed": resumed,
        "straight_wire": straight_wire[3:],
        "resumed_wire": resumed_wire,
        "dense": 4 * sum(p.numel() for p in model.parameters()),
        "refused": refused,
    }


@pytest.mark.parametrize("spec", ["csc:0.25:chunk=16", "topk:0.1"])
def test_a_saved_hook_state_continues_bit_for_bit_in_a_new_ddp(spec: str) -> None:
    """DDP's first backward after the load puts every parameter in one bucket; the hook
    cuts it into the two saved buckets and compresses it, as the uninterrupted run did."""
    for got in run_ranks(_resume_rank, 2, spec, timeout_s=120.0):
        for step, (a, b) in enumerate(zip(got["straight"], got["resumed"], strict=True)):
            for pa, pb in zip(a, b, strict=True):
                assert torch.equal(pa, pb), (spec, step, (pa - pb).abs().max())
        # the first step after the load compressed too (no lossless step), as the other run
        assert got["resumed_wire"] == got["straight_wire"], got
        assert max(got["resumed_wire"]) < got["dense"]
        assert "load a state into the model it was saved from" in got["refused"], got
