"""Where DDP's behaviour is pinned, DataParallel behaves the same: each scenario runs on 2 gloo
ranks once with torch's DistributedDataParallel and once with syncline's, and compares."""

from __future__ import annotations

import copy
import gc
import io
import warnings

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from syncline import DataParallel
from syncline.dp import build_compressor
from syncline.errors import ConfigError
from syncline.testing import run_ranks

KINDS = ("ddp", "syncline")
Grads = dict[str, torch.Tensor | None]


def _wrap(kind: str, model: nn.Module, **kwargs: object) -> nn.Module:
    with warnings.catch_warnings():  # DDP 2.13: broadcast_buffers is deprecated
        warnings.simplefilter("ignore", FutureWarning)
        return (DDP if kind == "ddp" else DataParallel)(model, **kwargs)  # type: ignore[arg-type]


def _grads(model: nn.Module) -> Grads:
    return {
        n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()
    }


def _assert_same_grads(got: Grads, want: Grads) -> None:
    assert got.keys() == want.keys()
    for name, w in want.items():
        g = got[name]
        if w is None or g is None:
            assert g is None and w is None, (name, g, w)
        else:
            assert torch.equal(g, w), (name, g, w)


# -- 1. parameters that differ across ranks ------------------------------------------------------


def _mismatched_model(rank: int, how: str) -> nn.Module:
    torch.manual_seed(0)
    if rank == 0:
        return nn.Sequential(nn.Linear(4, 3))
    if how == "count":
        return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 3))
    if how == "dtype":
        return nn.Sequential(nn.Linear(4, 3).double())
    return nn.Sequential(nn.Linear(4, 5))  # "shape"


def _construct_rank(rank: int, world: int, kind: str, how: str) -> tuple[str, str]:
    del world
    try:
        _wrap(kind, _mismatched_model(rank, how))
    except Exception as exc:  # the kind of error is the result
        return type(exc).__name__, str(exc).splitlines()[0]
    return "ok", ""


@pytest.mark.parametrize("how", ["count", "shape"])
def test_params_differ_across_ranks_fail_at_construction(how: str) -> None:
    """Ported from ``test_ddp_model_diff_num_params_across_ranks`` and
    ``test_ddp_model_diff_shape_across_ranks`` (torch/testing/_internal/distributed/
    distributed_test.py; DDP's ``_verify_param_shape_across_processes``).

    DDP refuses at construction (on at least one rank: on every rank for a different count,
    on the differing rank for a different shape); DataParallel raises ConfigError on every
    rank, before the initial broadcast, naming the difference.
    """
    ddp = run_ranks(_construct_rank, 2, "ddp", how, comm_timeout_s=20)
    ours = run_ranks(_construct_rank, 2, "syncline", how)
    assert any(kind in ("RuntimeError", "ValueError") for kind, _ in ddp), ddp
    assert [kind for kind, _ in ours] == ["ConfigError", "ConfigError"], ours
    assert ours[0] == ours[1]  # the same message on every rank
    message = ours[0][1]
    if how == "count":
        assert "rank 1 has 4 trainable parameters and rank 0 has 2" in message, message
        assert "'1.weight'" in message, message
    else:
        assert "'0.weight' of shape [5, 4]" in message and "shape [3, 4]" in message, message
        assert "rank 1" in message, message


def test_param_dtype_differs_across_ranks_refused_unlike_ddp() -> None:
    """Ported from ``test_ddp_model_diff_shape_across_ranks`` (distributed_test.py), with a
    dtype instead of a shape. A deliberate difference: DDP 2.13's
    ``_verify_param_shape_across_processes`` compares only sizes and accepts this (the
    construction succeeds, the ranks then reduce gradients of different types); DataParallel
    refuses it on every rank, naming both dtypes."""
    assert run_ranks(_construct_rank, 2, "ddp", "dtype") == [("ok", ""), ("ok", "")]
    ours = run_ranks(_construct_rank, 2, "syncline", "dtype")
    assert [kind for kind, _ in ours] == ["ConfigError", "ConfigError"], ours
    assert "torch.float64 on rank 1" in ours[0][1] and "torch.float32 on rank 0" in ours[0][1]


# -- 2.-4. unused parameters, re-wrapping, pickling, broadcast_buffers=False ---------------------


class TwoBranch(nn.Module):
    """``b`` takes part only when ``use_b`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(4, 3)
        self.use_b = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(x) if self.use_b else self.a(x)


def _x(rank: int, step: int) -> torch.Tensor:
    return torch.randn(2, 4, generator=torch.Generator().manual_seed(100 * step + rank))


def _unused_steps(rank: int, kind: str, lean: bool) -> list[Grads]:
    torch.manual_seed(0)
    model = TwoBranch()
    dp = _wrap(kind, model, find_unused_parameters=True, gradient_as_bucket_view=lean)
    out = []

    def step(k: int, use_b: bool, sync: bool = True) -> None:
        model.use_b = use_b
        if sync:
            dp(_x(rank, k)).sum().backward()
        else:
            with dp.no_sync():  # type: ignore[operator]
                dp(_x(rank, k)).sum().backward()

    step(1, use_b=True)  # every parameter used: averaged
    out.append(_grads(model))
    step(2, use_b=False)  # b unused everywhere, its gradient (from step 1) kept
    out.append(_grads(model))
    model.b.weight.grad = torch.full((3, 4), float(rank + 1))  # set by the user, per rank
    model.b.bias.grad = None
    step(3, use_b=False)
    out.append(_grads(model))
    model.zero_grad(set_to_none=True)
    step(4, use_b=False, sync=False)
    step(5, use_b=False)  # b never used since zero_grad: its gradient stays None
    out.append(_grads(model))
    model.zero_grad(set_to_none=True)
    step(6, use_b=True, sync=False)
    step(7, use_b=False)  # b used under no_sync: used in this window, so averaged
    out.append(_grads(model))
    return out


def _rewrap(rank: int, kind: str, keep_old: bool) -> Grads:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    old = _wrap(kind, model)
    old(_x(rank, 1)).sum().backward()
    if not keep_old:
        del old
        gc.collect()
    model.zero_grad(set_to_none=True)
    new = _wrap(kind, model)
    new(_x(rank, 2)).sum().backward()
    if keep_old:  # syncline only: the older wrapper was superseded
        with pytest.raises(ConfigError, match="superseded"):
            old(_x(rank, 3))
    return _grads(model)


def _local_buffers(rank: int, kind: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(rank)  # parameters and the buffer differ across ranks before wrapping
    model = nn.BatchNorm1d(3)
    with torch.no_grad():
        model.weight.add_(torch.randn(3))
        model.running_mean.add_(torch.randn(3))
    _wrap(kind, model, broadcast_buffers=False)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _behaviour_rank(rank: int, world: int, kind: str) -> dict[str, object]:
    del world
    out: dict[str, object] = {
        "unused": _unused_steps(rank, kind, lean=False),
        "unused_lean": _unused_steps(rank, kind, lean=True),
        "rewrap": _rewrap(rank, kind, keep_old=False),
        "buffers": _local_buffers(rank, kind),
    }
    if kind == "syncline":
        out["takeover"] = _rewrap(rank, kind, keep_old=True)
        # a compressor's state would not survive a pickle: refused (plain wrappers pickle,
        # see tests/dist/test_ddp_surface.py)
        dp = DataParallel(nn.Linear(2, 2), compression=build_compressor("topk:0.5"))
        for save in (lambda: torch.save(dp, io.BytesIO()), lambda: copy.deepcopy(dp)):
            with pytest.raises(ConfigError, match="state_dict"):
                save()
    return out


@pytest.fixture(scope="module")
def behaviour() -> dict[str, list[dict]]:
    return {kind: run_ranks(_behaviour_rank, 2, kind) for kind in KINDS}


@pytest.mark.parametrize("lean", [False, True], ids=["copy", "bucket-view"])
def test_unused_parameters_keep_their_gradient(behaviour, lean: bool) -> None:
    """Ported from ``test_undefined_grad_parity_unused_parameters`` (distributed_test.py),
    extended to existing gradients: DDP's reducer leaves a globally unused parameter's
    gradient untouched (``None`` stays ``None``; an existing one keeps its local value, or
    with ``gradient_as_bucket_view=True`` becomes the rank average, the bucket it views).
    """
    key = "unused_lean" if lean else "unused"
    for rank in range(2):
        steps_ddp, steps_ours = behaviour["ddp"][rank][key], behaviour["syncline"][rank][key]
        for got, want in zip(steps_ours, steps_ddp, strict=True):
            _assert_same_grads(got, want)
    # the scenario exercises what it claims: None kept, and a per-rank gradient kept
    assert behaviour["ddp"][0][key][3]["b.weight"] is None
    if not lean:
        assert torch.equal(behaviour["ddp"][1][key][2]["b.weight"], torch.full((3, 4), 2.0))


def test_rewrap_after_dropping_the_wrapper(behaviour) -> None:
    """Ported from ``test_ddp_remove_autograd_hooks`` (distributed_test.py): a module wrapped
    again runs only the new wrapper's hooks. Dropping the old DataParallel removes its hooks
    (``weakref.finalize``); a second one of a module whose wrapper is alive takes over."""
    for rank in range(2):
        want = behaviour["ddp"][rank]["rewrap"]
        _assert_same_grads(behaviour["syncline"][rank]["rewrap"], want)
        _assert_same_grads(behaviour["syncline"][rank]["takeover"], want)


def test_broadcast_buffers_false_keeps_local_buffers(behaviour) -> None:
    """Ported from ``test_ddp_init_sync_buffers_with_forward_sync_buffers_false`` and
    ``test_ddp_broadcast_buffers_deprecation_warning`` (distributed_test.py): with the
    deprecated ``broadcast_buffers=False``, DDP 2.13 leaves the buffers out of the initial
    broadcast (parameters still come from rank 0)."""
    for rank in range(2):
        want = behaviour["ddp"][rank]["buffers"]
        got = behaviour["syncline"][rank]["buffers"]
        for key, value in want.items():
            assert torch.equal(got[key], value), (rank, key)
    ddp = behaviour["ddp"]
    assert torch.equal(ddp[0]["buffers"]["weight"], ddp[1]["buffers"]["weight"])
    assert not torch.equal(ddp[0]["buffers"]["running_mean"], ddp[1]["buffers"]["running_mean"])
