"""Scenarios of PyTorch's own DDP test suite, ported: each runs on 2 gloo ranks once with torch's
DistributedDataParallel and once with syncline's DataParallel (called with the same arguments),
and the two must agree exactly, rank by rank: the same gradients, parameters and buffers, or the
same kind of error.

Every rank gets different data. Scenarios are batched into three rank functions (one process
launch per engine each); a scenario that raises is recorded as ``("error", type name, first
line)`` so that one failure does not hide the others.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from syncline import DataParallel
from syncline.testing import RankFailure, run_ranks

KINDS = ("ddp", "syncline")
READY_TWICE = "Expected to mark a variable ready only once"
Snapshot = dict[str, Any]

# -- helpers (run inside the ranks) --------------------------------------------------------------


def _wrap(kind: str, model: nn.Module, **kwargs: Any) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # broadcast_buffers deprecation and the like
        return (DDP if kind == "ddp" else DataParallel)(model, **kwargs)


def _attempt(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn``'s result, or ``("error", type name, first line)`` if it raised."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # checkpoint, create_graph and DDP warnings
            return fn(*args, **kwargs)
    except Exception as exc:  # the kind of error is the result
        lines = str(exc).strip().splitlines()
        return ("error", type(exc).__name__, lines[0] if lines else "")


def _x(rank: int, step: int, n: int = 3, d: int = 4, salt: int = 0) -> torch.Tensor:
    """Inputs that differ by rank and by step."""
    seed = 10_000 * salt + 100 * step + rank
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed))


def _grads(model: nn.Module) -> Snapshot:
    return {
        n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()
    }


def _params(model: nn.Module) -> Snapshot:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _bufs(model: nn.Module) -> Snapshot:
    return {n: b.detach().clone() for n, b in model.named_buffers()}


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1)


# -- helpers (run in the test process) -----------------------------------------------------------


def _is_error(value: Any) -> bool:
    return isinstance(value, tuple) and len(value) == 3 and value[0] == "error"


def _short(value: Any) -> str:
    return repr(value) if _is_error(value) else "a result"


def _dense(t: torch.Tensor) -> torch.Tensor:
    return t.to_dense() if t.is_sparse else t


def _assert_same(got: Any, want: Any, where: str, sparse_atol: float = 0.0) -> None:
    """``got`` (syncline) is ``want`` (DDP): tensors equal exactly (sparse ones densified, within
    ``sparse_atol``), errors of the same type, everything else equal."""
    if _is_error(want) or _is_error(got):
        assert _is_error(got) and _is_error(want) and got[1] == want[1], (
            f"{where}: syncline gave {_short(got)}, DDP gave {_short(want)}"
        )
        return
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), (where, got)
        assert got.is_sparse == want.is_sparse, f"{where}: sparse {got.is_sparse} != DDP's"
        g, w = _dense(got), _dense(want)
        assert g.dtype == w.dtype and g.shape == w.shape, (where, g.dtype, w.dtype)
        if want.is_sparse and sparse_atol:
            ok = torch.allclose(g, w, rtol=0.0, atol=sparse_atol)
        else:
            ok = torch.equal(g, w)
        assert ok, f"{where}: syncline {g.tolist()} != DDP {w.tolist()}"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), (
            f"{where}: keys {sorted(got) if isinstance(got, dict) else got} != {sorted(want)}"
        )
        for key in want:
            _assert_same(got[key], want[key], f"{where}/{key}", sparse_atol)
    elif isinstance(want, list | tuple):
        assert isinstance(got, list | tuple) and len(got) == len(want), (where, got, want)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_same(g, w, f"{where}[{i}]", sparse_atol)
    elif want is None or got is None:
        assert got is None and want is None, f"{where}: syncline {got!r} != DDP {want!r}"
    else:
        assert got == want, f"{where}: syncline {got!r} != DDP {want!r}"


Runs = dict[str, Any]


def _launch(fn: Callable[..., Any]) -> Runs:
    out: Runs = {}
    for kind in KINDS:
        try:
            out[kind] = run_ranks(fn, 2, kind, timeout_s=240, comm_timeout_s=30)
        except RankFailure as exc:  # reported by every test of this launch
            out[kind] = exc
    return out


def _ranks(runs: Runs, kind: str) -> list[dict[str, Any]]:
    result = runs[kind]
    if isinstance(result, Exception):
        pytest.fail(f"the {kind} ranks failed: {result}")
    return result


def _compare(runs: Runs, key: str, sparse_atol: float = 0.0) -> None:
    """syncline's result for scenario ``key`` is DDP's, on each rank."""
    ddp, ours = _ranks(runs, "ddp"), _ranks(runs, "syncline")
    for rank in range(2):
        _assert_same(ours[rank][key], ddp[rank][key], f"rank {rank} {key}", sparse_atol)


def _ddp(runs: Runs, key: str, rank: int = 0) -> Any:
    return _ranks(runs, "ddp")[rank][key]


def _ok(value: Any, what: str) -> None:
    assert not _is_error(value), f"{what}: {value}"


# -- 1. activation checkpointing -----------------------------------------------------------------


class Checkpointed(nn.Module):
    """Three Linear(4, 4); ``l3`` ("last": the first in backward) or ``l2`` ("middle") runs
    under ``torch.utils.checkpoint`` ``times`` times in a row."""

    def __init__(self, where: str, times: int, reentrant: bool) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.target = "l3" if where == "last" else "l2"
        self.times, self.reentrant = times, reentrant

    def _run(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if layer is not getattr(self, self.target):
            return layer(x)
        for _ in range(self.times):
            x = checkpoint(layer, x, use_reentrant=self.reentrant)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self._run(self.l1, x))
        x = torch.tanh(self._run(self.l2, x))
        return self._run(self.l3, x)


def _ckpt_train(
    rank: int,
    kind: str,
    where: str,
    times: int,
    reentrant: bool,
    lean: bool = False,
    find_unused: bool = False,
) -> list[Snapshot]:
    torch.manual_seed(0)
    model = Checkpointed(where, times, reentrant)
    dp = _wrap(kind, model, gradient_as_bucket_view=lean, find_unused_parameters=find_unused)
    opt = _sgd(model)
    out = []
    for step in range(3):
        opt.zero_grad(set_to_none=False)
        dp(_x(rank, step)).sum().backward()
        out.append(_grads(model))
        opt.step()
    out.append(_params(model))
    return out


def _ckpt_reference(where: str) -> list[Snapshot]:
    """One process, both ranks' inputs: the loss whose gradient is the 2-rank average."""
    torch.manual_seed(0)
    model = Checkpointed(where, 1, reentrant=False)
    opt = _sgd(model)
    out = []
    for step in range(3):
        opt.zero_grad(set_to_none=False)
        (model(torch.cat([_x(0, step), _x(1, step)])).sum() / 2).backward()
        out.append(_grads(model))
        opt.step()
    out.append(_params(model))
    return out


class OneUsed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(4, 3, bias=False)
        self.net2 = nn.Linear(4, 3, bias=False)  # never used

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net1(x)


def _unused_without_find(rank: int, kind: str) -> list[Any]:
    torch.manual_seed(0)
    dp = _wrap(kind, OneUsed())

    def step(k: int) -> str:
        dp(_x(rank, k)).sum().backward()
        return "ok"

    return [_attempt(step, k) for k in range(2)]


def _checkpoint_rank(rank: int, world: int, kind: str) -> dict[str, Any]:
    del world
    out: dict[str, Any] = {}
    for where in ("last", "middle"):
        out[f"ref/{where}"] = _ckpt_reference(where)
        for reentrant in (True, False):
            for lean in (False, True):
                out[f"once/{where}/{reentrant}/{lean}"] = _attempt(
                    _ckpt_train, rank, kind, where, 1, reentrant, lean=lean
                )
                out[f"unused/{where}/{reentrant}/{lean}"] = _attempt(
                    _ckpt_train, rank, kind, where, 1, reentrant, lean=lean, find_unused=True
                )
            for find_unused in (False, True):
                out[f"twice/{where}/{reentrant}/{find_unused}"] = _attempt(
                    _ckpt_train, rank, kind, where, 2, reentrant, find_unused=find_unused
                )
    out["rebuild"] = _unused_without_find(rank, kind)  # last: it leaves a reduction unfinished
    return out


@pytest.fixture(scope="module")
def ckpt_runs() -> Runs:
    return _launch(_checkpoint_rank)


@pytest.mark.parametrize("where", ["last", "middle"])
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_ddp_checkpointing_once(ckpt_runs: Runs, reentrant: bool, where: str) -> None:
    """Ported from ``test_ddp_checkpointing_once`` (test/distributed/test_c10d_common.py): a
    layer checkpointed once (``use_reentrant`` True and False), ``gradient_as_bucket_view``
    False and True, three steps with SGD in between: the same gradients and parameters as DDP.
    """
    for lean in (False, True):
        key = f"once/{where}/{reentrant}/{lean}"
        _ok(_ddp(ckpt_runs, key), f"DDP {key}")
        _compare(ckpt_runs, key)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_ddp_checkpointing_twice(ckpt_runs: Runs, reentrant: bool) -> None:
    """Ported from ``test_ddp_checkpointing_twice`` (test/distributed/test_c10d_common.py): the
    same layer checkpointed twice in one forward, with and without find_unused_parameters.
    Reentrant: its parameters become ready twice in one backward, DDP raises RuntimeError
    ("Expected to mark a variable ready only once") and DataParallel must raise RuntimeError
    too. Non-reentrant: it works, with DDP's gradients."""
    for where in ("last", "middle"):
        for find_unused in (False, True):
            key = f"twice/{where}/{reentrant}/{find_unused}"
            ddp = _ddp(ckpt_runs, key)
            if reentrant:
                assert _is_error(ddp) and READY_TWICE in ddp[2], (key, ddp)
                for rank, ours in enumerate(_ranks(ckpt_runs, "syncline")):
                    got = ours[key]
                    assert _is_error(got) and got[1] == "RuntimeError", (rank, key, _short(got))
            else:
                _ok(ddp, f"DDP {key}")
                _compare(ckpt_runs, key)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_ddp_checkpointing_unused_params(ckpt_runs: Runs, reentrant: bool) -> None:
    """Ported from ``test_ddp_checkpointing_unused_params`` (test/distributed/
    test_c10d_common.py): find_unused_parameters=True with a checkpointed layer. Reentrant: DDP's
    graph search cannot see the parameters inside the checkpoint, marks them unused, then sees
    their gradients, and raises; DataParallel deliberately trains correctly: its gradients are
    those of one process running both ranks' inputs (sum loss halved). Non-reentrant: DDP's
    gradients exactly."""
    for where in ("last", "middle"):
        ref = _ranks(ckpt_runs, "syncline")[0][f"ref/{where}"]
        for lean in (False, True):
            key = f"unused/{where}/{reentrant}/{lean}"
            ddp = _ddp(ckpt_runs, key)
            if not reentrant:
                _ok(ddp, f"DDP {key}")
                _compare(ckpt_runs, key)
                continue
            assert _is_error(ddp) and READY_TWICE in ddp[2], (key, ddp)
            for rank, ours in enumerate(_ranks(ckpt_runs, "syncline")):
                got = ours[key]
                _ok(got, f"syncline rank {rank} {key}")
                for i, (g_step, r_step) in enumerate(zip(got, ref, strict=True)):
                    for name, want in r_step.items():
                        assert g_step[name] is not None, (rank, key, i, name)
                        assert torch.allclose(g_step[name], want, rtol=0.0, atol=1e-6), (
                            f"rank {rank} {key} step {i} {name}: {g_step[name]} != {want}"
                        )


def test_ddp_unused_params_rebuild_buckets_exception(ckpt_runs: Runs) -> None:
    """Ported from ``test_ddp_unused_params_rebuild_buckets_exception`` (torch/testing/_internal/
    distributed/distributed_test.py): a parameter never used, find_unused_parameters=False. DDP
    lets the first iteration pass (its reduction left unfinished) and raises RuntimeError in the
    second ("Expected to have finished reduction in the prior iteration"). DataParallel raises
    RuntimeError one iteration earlier, on purpose: at the end of the first backward, since the
    only output was backpropagated and no later backward can still bring the gradient, naming
    the parameter (a step whose gradients are not averaged never reaches the optimizer)."""
    ddp = _ddp(ckpt_runs, "rebuild")
    assert ddp[0] == "ok" and _is_error(ddp[1]) and ddp[1][1] == "RuntimeError", ddp
    for rank, ours in enumerate(_ranks(ckpt_runs, "syncline")):
        first = ours["rebuild"][0]
        assert _is_error(first) and first[1] == "RuntimeError", (rank, ours["rebuild"])
        assert "net2.weight" in first[2], first


# -- 2., 3., 6. buffers; init_sync / forward_sync_buffers; ignored parameters; state_dict --------


class Scaled(nn.Module):
    """``lin(x) * scale`` with ``scale`` a buffer (rank-dependent until synchronised)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.scale: torch.Tensor
        self.register_buffer("scale", torch.full((3,), rank + 1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def _buffer_steps(
    rank: int, kind: str, how: str, seed_by_rank: bool = False, **kwargs: Any
) -> Snapshot:
    torch.manual_seed(rank if seed_by_rank else 0)
    model = Scaled(rank)
    dp = _wrap(kind, model, **kwargs)
    out: Snapshot = {"init": {"params": _params(model), "buffers": _bufs(model)}, "steps": []}
    opt = _sgd(model)
    for step in range(3):
        if step and how == "reassign":  # the user swaps the buffer, differently on each rank
            model.scale = model.scale + (rank + 1)
        elif step and how == "inplace":
            model.scale.add_(rank + 1)
        opt.zero_grad()
        dp(_x(rank, step)).sum().backward()
        out["steps"].append({"grads": _grads(model), "buffers": _bufs(model)})
        opt.step()
    out["params"] = _params(model)
    return out


def _two_forwards(rank: int, kind: str) -> list[Snapshot]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    dp = _wrap(kind, model)
    # per-element weights: BatchNorm's outputs sum to zero per feature, so a plain sum has ~0 grad
    w = torch.randn(4, 3, generator=torch.Generator().manual_seed(7))
    out = []
    for step in range(2):
        model.zero_grad()
        y = dp(_x(rank, 2 * step, n=4)) + dp(_x(rank, 2 * step + 1, n=4))
        (y * w).sum().backward()
        out.append({"grads": _grads(model), "buffers": _bufs(model)})
    return out


class WithIgnored(nn.Module):
    """``head`` and the buffer ``shift`` are to be ignored by DDP; ``offset`` is synchronised."""

    def __init__(self, rank: int, shapes: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.head = nn.Linear(3, 3)
        with torch.no_grad():
            self.head.weight.add_(rank)  # differs across ranks, and stays so
        self.register_buffer("shift", torch.full((3,), rank + 1.0))
        self.register_buffer("offset", torch.full((3,), 10.0 * (rank + 1)))
        if shapes:  # ignored tensors may even differ in shape (DDP checks only the others)
            self.extra = nn.Module()  # in a submodule: DDP 2.13 names a root parameter ".proxy"
            self.extra.proxy = nn.Parameter(torch.zeros(2 + rank))
            self.extra.register_buffer("odd", torch.zeros(5 + rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.lin(x) + self.offset)) + self.shift


def _ignore_params(rank: int, kind: str, shapes: bool) -> Snapshot:
    torch.manual_seed(0)
    model = WithIgnored(rank, shapes)
    ignored = ["head.weight", "head.bias", "shift"] + (
        ["extra.proxy", "extra.odd"] if shapes else []
    )
    DDP._set_params_and_buffers_to_ignore_for_model(model, ignored)
    dp = _wrap(kind, model)
    out: Snapshot = {"init": {"params": _params(model), "buffers": _bufs(model)}, "steps": []}
    opt = _sgd(model)
    for step in range(2):
        opt.zero_grad()
        dp(_x(rank, step)).pow(2).sum().backward()
        out["steps"].append({"grads": _grads(model), "buffers": _bufs(model)})
        opt.step()
    out["params"] = _params(model)
    return out


def _state_dict_round_trip(rank: int, kind: str) -> Snapshot:
    def make() -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
        return model, _wrap(kind, model), _sgd(model)

    def train(dp: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
        for step in steps:
            opt.zero_grad()
            dp(_x(rank, step)).pow(2).sum().backward()
            opt.step()

    model, dp, opt = make()
    train(dp, opt, range(2))
    saved = {k: v.clone() for k, v in dp.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    dp.load_state_dict(saved)
    plain = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    stripped = dict(saved)
    consume_prefix_in_state_dict_if_present(stripped, "module.")
    plain.load_state_dict(stripped)
    train(dp, opt, range(2, 4))
    other, dp_other, opt_other = make()  # the same 4 steps without the round trip
    train(dp_other, opt_other, range(4))
    return {
        "keys": sorted(saved),
        "loaded": _params(plain),
        "final": _params(model),
        "without_round_trip": _params(other),
    }


def _state_rank(rank: int, world: int, kind: str) -> dict[str, Any]:
    del world
    return {
        "reassign": _attempt(_buffer_steps, rank, kind, "reassign"),
        "inplace": _attempt(_buffer_steps, rank, kind, "inplace"),
        "two_forwards": _attempt(_two_forwards, rank, kind),
        "init_sync_false": _attempt(
            _buffer_steps, rank, kind, "inplace", seed_by_rank=True, init_sync=False
        ),
        "forward_sync_false": _attempt(
            _buffer_steps, rank, kind, "inplace", forward_sync_buffers=False
        ),
        "no_sync_at_all": _attempt(
            _buffer_steps,
            rank,
            kind,
            "inplace",
            seed_by_rank=True,
            init_sync=False,
            forward_sync_buffers=False,
        ),
        "ignore": _attempt(_ignore_params, rank, kind, shapes=False),
        "ignore_shapes": _attempt(_ignore_params, rank, kind, shapes=True),
        "state_dict": _attempt(_state_dict_round_trip, rank, kind),
    }


@pytest.fixture(scope="module")
def state_runs() -> Runs:
    return _launch(_state_rank)


@pytest.mark.parametrize("how", ["reassign", "inplace"])
def test_ddp_broadcast_buffer_changed_between_steps(state_runs: Runs, how: str) -> None:
    """Ported from ``test_ddp_broadcast_buffer`` (torch/testing/_internal/distributed/
    distributed_test.py; pytorch issue 63916, DDP's ``_sync_buffers`` re-reading the module's
    buffers through ``_assign_modules_buffers`` before each forward): a buffer used in forward
    is changed by the user between steps, differently on each rank, either reassigned
    (``m.scale = m.scale + rank + 1``) or in place (``m.scale.add_(rank + 1)``). DDP sends rank
    0's current buffers before every forward: the same gradients and buffers after each step."""
    _ok(_ddp(state_runs, how), f"DDP {how}")
    _compare(state_runs, how)
    steps = _ddp(state_runs, how, rank=1)["steps"]  # rank 1 trains on rank 0's value
    assert torch.equal(steps[1]["buffers"]["scale"], torch.full((3,), 2.0)), steps[1]


def test_ddp_buffer_sync_multi_forward_with_batchnorm(state_runs: Runs) -> None:
    """Ported from ``test_ddp_buffer_sync_multi_forward_with_batchnorm`` (test/distributed/
    test_c10d_common.py): Linear + BatchNorm1d, two forwards then one backward of their sum, two
    steps. DDP re-sends rank 0's running statistics before the second forward too: the same
    gradients and running statistics (on each rank, after each step) as DDP."""
    _ok(_ddp(state_runs, "two_forwards"), "DDP two_forwards")
    _compare(state_runs, "two_forwards")


def test_ddp_init_sync_false(state_runs: Runs) -> None:
    """Ported from ``test_ddp_no_init_sync`` (test/distributed/test_c10d_pypg.py; DDP 2.13's
    ``init_sync`` argument): with ``init_sync=False`` the ranks keep their own parameters and
    buffers at construction (no broadcast); the buffers are still sent before each forward."""
    _ok(_ddp(state_runs, "init_sync_false"), "DDP init_sync_false")
    _compare(state_runs, "init_sync_false")
    p0, p1 = (_ddp(state_runs, "init_sync_false", r)["init"]["params"] for r in range(2))
    assert not torch.equal(p0["lin.weight"], p1["lin.weight"])  # really kept apart


@pytest.mark.parametrize("key", ["forward_sync_false", "no_sync_at_all"])
def test_ddp_init_sync_buffers_with_forward_sync_buffers_false(state_runs: Runs, key: str) -> None:
    """Ported from ``test_ddp_init_sync_buffers_with_forward_sync_buffers_false``
    (torch/testing/_internal/distributed/distributed_test.py): ``forward_sync_buffers=False``
    still sends rank 0's buffers at construction, and never again: a buffer changed per rank
    stays per rank. With ``init_sync=False`` as well, nothing is sent at all."""
    _ok(_ddp(state_runs, key), f"DDP {key}")
    _compare(state_runs, key)
    last = [_ddp(state_runs, key, r)["steps"][-1]["buffers"]["scale"] for r in range(2)]
    assert not torch.equal(last[0], last[1])


@pytest.mark.parametrize("shapes", [False, True], ids=["same-shapes", "shapes-differ"])
def test_ddp_ignore_params_arg(state_runs: Runs, shapes: bool) -> None:
    """Ported from ``test_ddp_ignore_params_arg`` (torch/testing/_internal/distributed/
    distributed_test.py): ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``
    before wrapping. The ignored parameters are not broadcast and their gradients not averaged;
    the ignored buffer is not synchronised (the others are); ignored tensors may differ in shape
    across ranks."""
    key = "ignore_shapes" if shapes else "ignore"
    _ok(_ddp(state_runs, key), f"DDP {key}")
    _compare(state_runs, key)
    d0, d1 = (_ddp(state_runs, key, r) for r in range(2))
    assert not torch.equal(d0["params"]["head.weight"], d1["params"]["head.weight"])
    assert torch.equal(d0["params"]["lin.weight"], d1["params"]["lin.weight"])
    assert not torch.equal(d0["init"]["buffers"]["shift"], d1["init"]["buffers"]["shift"])


def test_save_load_checkpoint(state_runs: Runs) -> None:
    """Ported from ``test_save_load_checkpoint`` (test/distributed/test_c10d_gloo.py): the
    wrapper's ``state_dict`` (keys prefixed ``module.``, as DDP's) saved after 2 steps, the
    parameters zeroed, loaded back, 2 more steps: the same as 4 steps without the round trip, and
    the stripped dict loads into the plain module; all as DDP."""
    _ok(_ddp(state_runs, "state_dict"), "DDP state_dict")
    _compare(state_runs, "state_dict")
    for rank, ours in enumerate(_ranks(state_runs, "syncline")):
        got = ours["state_dict"]
        if not _is_error(got):
            _assert_same(got["final"], got["without_round_trip"], f"rank {rank} round trip")


# -- 4., 5., 7. dtypes, sparse gradients, and the rest -------------------------------------------


class MixedDtypes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(4, 3)
        self.l2 = nn.Linear(3, 2).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.tanh(self.l1(x)).double())


class SparseNet(nn.Module):
    def __init__(self, bag: bool) -> None:
        super().__init__()
        self.bag = bag
        self.emb = nn.EmbeddingBag(10, 3, mode="sum", sparse=True) if bag else None
        self.table = None if bag else nn.Embedding(10, 3, sparse=True)
        self.lin = nn.Linear(3, 2)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        e = self.emb(idx) if self.emb is not None else self.table(idx).sum(1)  # type: ignore[misc]
        return self.lin(e)


def _train(
    rank: int,
    kind: str,
    model: nn.Module,
    steps: int = 2,
    data: Callable[[int, int], Any] = _x,
    **kwargs: Any,
) -> list[Snapshot]:
    """``steps`` SGD steps of ``sum(out ** 2)``; the gradients after each."""
    dp = _wrap(kind, model, **kwargs)
    opt = _sgd(model)
    out = []
    for step in range(steps):
        opt.zero_grad()
        dp(data(rank, step)).pow(2).sum().backward()
        out.append(_grads(model))
        opt.step()
    return out


def _indices(rank: int, step: int) -> torch.Tensor:
    return torch.randint(0, 10, (4, 2), generator=torch.Generator().manual_seed(10 * step + rank))


def _accumulate_no_sync(rank: int, kind: str, lean: bool) -> list[Snapshot]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    dp = _wrap(kind, model, gradient_as_bucket_view=lean)
    with torch.no_grad(), dp.no_sync():  # type: ignore[operator]
        dp(_x(rank, 9))  # no gradient, nothing accumulated
    out = []
    for it in range(4):  # no zero_grad: gradients accumulate across all four
        if it % 2 == 0:
            with dp.no_sync():  # type: ignore[operator]
                dp(_x(rank, it)).pow(2).sum().backward()
        else:
            dp(_x(rank, it)).pow(2).sum().backward()
        out.append(_grads(model))
    return out


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.m0 = nn.Sequential(nn.Linear(4, 3), nn.Tanh())
        self.m1 = nn.Sequential(nn.Linear(4, 3), nn.Tanh())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.m0(x), self.m1(x)


def _multiple_backward(rank: int, kind: str, lean: bool) -> list[Snapshot]:
    torch.manual_seed(0)
    model = TwoHeads()
    dp = _wrap(kind, model, gradient_as_bucket_view=lean)
    out = []
    for step in range(2):
        model.zero_grad()
        o1, o2 = dp(_x(rank, step))
        o1.pow(2).sum().backward()
        o2.pow(2).sum().backward()
        out.append(_grads(model))
    return out


def _one_head_only(rank: int, kind: str) -> list[Any]:
    """Two outputs, only the first backpropagated, find_unused_parameters=False."""
    torch.manual_seed(0)
    dp = _wrap(kind, TwoHeads())

    def step(k: int) -> str:
        o1, _ = dp(_x(rank, k))
        o1.sum().backward()
        return "ok"

    return [_attempt(step, k) for k in range(2)]


class Pair(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


@dataclass
class Outputs:
    o1: torch.Tensor | None
    o2: dict[str, torch.Tensor]


class Structured(nn.Module):
    """A NamedTuple in, a dataclass holding a dict out; ``seq1`` unused when ``skip_o1``."""

    def __init__(self, skip_o1: bool) -> None:
        super().__init__()
        self.seq1 = nn.Linear(4, 3)
        self.seq2 = nn.Linear(4, 3)
        self.skip_o1 = skip_o1
        self.seen: list[str] = []

    def forward(self, inp: Pair) -> Outputs:
        self.seen.append(type(inp).__name__)
        x = inp.a * inp.b
        o1 = None if self.skip_o1 else torch.tanh(self.seq1(x))
        return Outputs(o1=o1, o2={"a": self.seq2(x), "b": torch.relu(self.seq2(x))})


def _structured(rank: int, kind: str, skip_o1: bool) -> Snapshot:
    torch.manual_seed(0)
    model = Structured(skip_o1)
    dp = _wrap(kind, model, find_unused_parameters=True)
    steps = []
    for step in range(2):
        model.zero_grad()
        out = dp(Pair(_x(rank, step), _x(rank, step, salt=1)))
        total = out.o2["a"] + out.o2["b"] + (0 if out.o1 is None else out.o1)
        total.pow(2).sum().backward()
        steps.append(_grads(model))
    return {"seen": model.seen, "steps": steps}


class DetachedOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 3, bias=False)
        self.fc2 = nn.Linear(3, 3, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.fc2(torch.relu(self.fc1(x)))
        return x.detach(), x.clone()


def _no_grad_output(rank: int, kind: str, find_unused: bool) -> list[Any]:
    torch.manual_seed(0)
    model = DetachedOut()
    dp = _wrap(kind, model, find_unused_parameters=find_unused)
    out: list[Any] = []
    for step in range(3):
        model.zero_grad()
        a, b = dp(_x(rank, step))
        out.append(a.requires_grad)
        (a + b).pow(2).sum().backward()
        out.append(_grads(model))
    return out


class SharedBias(nn.Module):
    """``net1`` (its bias shared with ``self.bias``) is unused: pytorch issues 41324, 61982."""

    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(4, 3, bias=False)
        self.bias = nn.Parameter(torch.zeros(3))
        self.net1.bias = self.bias
        self.net2 = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(x).pow(2).sum()


def _shared_grad_acc(rank: int, kind: str) -> list[Snapshot]:
    torch.manual_seed(0)
    model = SharedBias()
    dp = _wrap(kind, model, find_unused_parameters=True)
    out = []
    for step in range(3):
        loss = dp(_x(rank, step))
        loss /= 10
        loss.backward()
        out.append(_grads(model))
    return out


class Squared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.tensor(1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.p.pow(2) * x


def _create_graph(rank: int, kind: str) -> list[Snapshot]:
    torch.manual_seed(0)
    model = Squared()
    dp = _wrap(kind, model)
    out = []
    for step in range(3):  # no zero_grad, as upstream: the gradients accumulate
        dp(torch.tensor(1.0 + rank + step)).backward(create_graph=True)
        out.append(_grads(model))
    return out


class NewTensors(nn.Module):
    """Returns tensors made in forward, not from the parameters (pytorch issue 60733)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 3, bias=False)
        self.fc2 = nn.Linear(3, 3, bias=False)

    def forward(
        self, x: torch.Tensor, opt_1: torch.Tensor | None, opt_nested: Any
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        x = self.fc2(torch.relu(self.fc1(x)))
        if opt_1 is None:
            opt_1 = torch.ones(1, 3)
        if opt_nested is None:
            opt_nested = torch.full((1, 3), 2.0)
        return x, opt_1, {"tensor": opt_nested}


def _new_tensor_in_fwd(rank: int, kind: str, find_unused: bool) -> list[Any]:
    torch.manual_seed(0)
    model = NewTensors()
    dp = _wrap(kind, model, find_unused_parameters=find_unused)
    opt_1: torch.Tensor | None = None
    opt_nested: Any = None
    out: list[Any] = []
    for step in range(2):
        model.zero_grad()
        y, opt_1, nested = dp(_x(rank, step), opt_1=opt_1, opt_nested=opt_nested)
        opt_nested = nested["tensor"]
        out.append((opt_1.grad_fn is None, opt_nested.grad_fn is None))
        y.mean().backward()
        out.append(_grads(model))
    return out


class MaybeUnused(nn.Module):
    def __init__(self, unused: bool) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 3, bias=False)
        self.fc2 = nn.Linear(3, 2, bias=False)
        self.fc3 = nn.Linear(2, 2, bias=False) if unused else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(torch.relu(self.fc2(torch.relu(self.fc1(x)))), dim=1)


def _ignored_output(rank: int, kind: str, find_unused: bool) -> list[Snapshot]:
    torch.manual_seed(0)
    model = MaybeUnused(unused=find_unused)
    dp = _wrap(kind, model, find_unused_parameters=find_unused)
    for step in range(3):  # outputs thrown away: no backward is owed
        output = dp(_x(rank, step))
        del output
    out = []
    for step in range(3, 6):
        model.zero_grad()
        dp(_x(rank, step)).pow(2).sum().backward()
        out.append(_grads(model))
    return out


class Tasks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.t0 = nn.Linear(4, 3)
        self.t1 = nn.Linear(4, 3)
        self.task_unused = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        return self.t0(x) if rank == 0 else self.t1(x)


def _global_local_unused(rank: int, kind: str, lean: bool) -> list[Snapshot]:
    torch.manual_seed(0)
    model = Tasks()
    dp = _wrap(kind, model, find_unused_parameters=True, gradient_as_bucket_view=lean)
    out = []
    for step in range(2):
        model.zero_grad(set_to_none=False)
        dp(_x(rank, step), rank).pow(2).mean().backward()
        out.append(_grads(model))
    return out


def _misc_rank(rank: int, world: int, kind: str) -> dict[str, Any]:
    del world
    out: dict[str, Any] = {}

    def seeded(make: Callable[[], nn.Module]) -> nn.Module:
        torch.manual_seed(0)
        return make()

    for lean in (False, True):
        out[f"dtypes/{lean}"] = _attempt(
            _train, rank, kind, seeded(MixedDtypes), gradient_as_bucket_view=lean
        )
        for bag in (False, True):
            out[f"sparse/{bag}/{lean}"] = _attempt(
                _train,
                rank,
                kind,
                seeded(lambda bag=bag: SparseNet(bag)),  # type: ignore[misc]
                data=_indices,
                gradient_as_bucket_view=lean,
            )
        out[f"no_sync/{lean}"] = _attempt(_accumulate_no_sync, rank, kind, lean)
        out[f"multi_backward/{lean}"] = _attempt(_multiple_backward, rank, kind, lean)
        out[f"global_local/{lean}"] = _attempt(_global_local_unused, rank, kind, lean)
    out["one_head_only"] = _one_head_only(rank, kind)
    for flag in (False, True):
        out[f"structured/{flag}"] = _attempt(_structured, rank, kind, flag)
        out[f"no_grad_output/{flag}"] = _attempt(_no_grad_output, rank, kind, flag)
        out[f"new_tensor/{flag}"] = _attempt(_new_tensor_in_fwd, rank, kind, flag)
        out[f"ignored_output/{flag}"] = _attempt(_ignored_output, rank, kind, flag)
    out["shared_grad_acc"] = _attempt(_shared_grad_acc, rank, kind)
    out["create_graph"] = _attempt(_create_graph, rank, kind)
    return out


@pytest.fixture(scope="module")
def misc_runs() -> Runs:
    return _launch(_misc_rank)


def test_mixed_parameter_dtypes(misc_runs: Runs) -> None:
    """Ported from the mixed-dtype part of ``test_ddp_logging_data_cpu`` (torch/testing/_internal/
    distributed/distributed_test.py, ``model.fc1.double()``: DDP buckets float64 and float32
    separately, cf. ``test_single_limit_multi_dtype`` in test/distributed/test_c10d_common.py):
    a float32 Linear then a float64 one, gradient_as_bucket_view False and True: the same
    gradients as DDP."""
    for lean in (False, True):
        _ok(_ddp(misc_runs, f"dtypes/{lean}"), "DDP dtypes")
        _compare(misc_runs, f"dtypes/{lean}")


@pytest.mark.parametrize("bag", [False, True], ids=["Embedding", "EmbeddingBag"])
def test_sparse_gradients(misc_runs: Runs, bag: bool) -> None:
    """Ported from ``test_sparse_gradients`` and ``test_sparse_gradients_grad_is_view``
    (test/distributed/test_c10d_gloo.py): ``nn.Embedding(10, 3, sparse=True)`` or
    ``nn.EmbeddingBag(10, 3, sparse=True)`` then a dense Linear, different indices per rank, two
    SGD steps: the table's gradient stays sparse exactly when DDP's does, and has DDP's values
    (densified; the order of summing duplicate rows may differ); the Linear's are DDP's exactly."""
    for lean in (False, True):
        key = f"sparse/{bag}/{lean}"
        ddp = _ddp(misc_runs, key)
        _ok(ddp, f"DDP {key}")
        assert ddp[0]["emb.weight" if bag else "table.weight"].is_sparse
        _compare(misc_runs, key, sparse_atol=1e-6)


def test_accumulate_gradients_no_sync(misc_runs: Runs) -> None:
    """Ported from ``test_accumulate_gradients_no_sync`` and
    ``test_accumulate_gradients_no_sync_grad_is_view`` (torch/testing/_internal/distributed/
    distributed_test.py): a forward under ``torch.no_grad()`` inside ``no_sync`` accumulates
    nothing; then iterations alternate ``no_sync`` (local accumulation) and synchronised (the
    accumulated total averaged), without zero_grad: DDP's gradients after every iteration."""
    for lean in (False, True):
        _ok(_ddp(misc_runs, f"no_sync/{lean}"), "DDP no_sync")
        _compare(misc_runs, f"no_sync/{lean}")


def test_multiple_outputs_multiple_backward(misc_runs: Runs) -> None:
    """Ported from ``test_multiple_outputs_multiple_backward`` and its ``_grad_is_view`` variant
    (test/distributed/test_c10d_nccl.py): one forward, two outputs from disjoint halves of the
    model, one backward per output; the reduction completes across both: DDP's gradients."""
    for lean in (False, True):
        _ok(_ddp(misc_runs, f"multi_backward/{lean}"), "DDP multi_backward")
        _compare(misc_runs, f"multi_backward/{lean}")


def test_output_never_backpropagated_fails_at_next_forward(misc_runs: Runs) -> None:
    """The other side of ``test_multiple_outputs_multiple_backward`` (test_c10d_nccl.py) and of
    ``test_ddp_unused_params_rebuild_buckets_exception`` (distributed_test.py): the second
    output's parameters wait for a backward that never comes. Both engines let the first
    iteration end (a later backward could still bring those gradients) and raise RuntimeError
    at the next forward; DataParallel's message names the waiting parameters."""
    for rank in range(2):
        ddp = _ranks(misc_runs, "ddp")[rank]["one_head_only"]
        ours = _ranks(misc_runs, "syncline")[rank]["one_head_only"]
        assert ddp[0] == "ok" and _is_error(ddp[1]) and ddp[1][1] == "RuntimeError", ddp
        assert ours[0] == "ok" and _is_error(ours[1]) and ours[1][1] == "RuntimeError", ours
        assert "m1.0.weight" in ours[1][2], ours


@pytest.mark.parametrize("skip_o1", [False, True], ids=["all-used", "o1-unused"])
def test_ddp_namedtuple_and_dataclass_output(misc_runs: Runs, skip_o1: bool) -> None:
    """Ported from ``test_ddp_namedtuple`` (torch/testing/_internal/distributed/
    distributed_test.py: a NamedTuple input reaches the module as that NamedTuple) and
    ``test_dataclass_output`` / ``test_dataclass_output_unused_param`` (test/distributed/
    test_c10d_common.py: a dataclass output holding a dict and maybe ``None``, with
    find_unused_parameters=True): DDP's gradients, ``seq1``'s ``None`` when unused."""
    key = f"structured/{skip_o1}"
    ddp = _ddp(misc_runs, key)
    _ok(ddp, f"DDP {key}")
    assert ddp["seen"] == ["Pair", "Pair"], ddp["seen"]
    _compare(misc_runs, key)


def test_ddp_returns_tensor_with_no_grad(misc_runs: Runs) -> None:
    """Ported from ``test_ddp_returns_tensor_with_no_grad`` (torch/testing/_internal/distributed/
    distributed_test.py): the module returns a detached tensor beside one with grad, with and
    without find_unused_parameters: the detached output stays detached, DDP's gradients."""
    for flag in (False, True):
        key = f"no_grad_output/{flag}"
        ddp = _ddp(misc_runs, key)
        _ok(ddp, f"DDP {key}")
        assert ddp[0] is False, ddp[0]
        _compare(misc_runs, key)


def test_ddp_shared_grad_acc_unused_params(misc_runs: Runs) -> None:
    """Ported from ``test_ddp_shared_grad_acc_unused_params`` (torch/testing/_internal/
    distributed/distributed_test.py): an unused parameter registered under two names (sharing
    one gradient accumulator), find_unused_parameters=True, the loss divided in place: DDP's
    gradients (``None`` for the unused ones) over three iterations."""
    _ok(_ddp(misc_runs, "shared_grad_acc"), "DDP shared_grad_acc")
    _compare(misc_runs, "shared_grad_acc")


def test_ddp_create_graph(misc_runs: Runs) -> None:
    """Ported from ``test_ddp_create_graph`` (torch/testing/_internal/distributed/
    distributed_test.py; pytorch issue 63929): ``p.pow(2) * x`` (``x`` per rank),
    ``backward(create_graph=True)`` three times without zero_grad: DDP's averaged, accumulated
    gradients."""
    _ok(_ddp(misc_runs, "create_graph"), "DDP create_graph")
    _compare(misc_runs, "create_graph")


def test_ddp_new_tensor_in_fwd(misc_runs: Runs) -> None:
    """Ported from ``test_ddp_new_tensor_in_fwd`` (torch/testing/_internal/distributed/
    distributed_test.py; pytorch issue 60733): forward returns tensors it created (not from the
    parameters), also nested in a dict, fed back in the next call, with and without
    find_unused_parameters: they get no ``grad_fn``; DDP's gradients."""
    for flag in (False, True):
        key = f"new_tensor/{flag}"
        ddp = _ddp(misc_runs, key)
        _ok(ddp, f"DDP {key}")
        assert ddp[0] == (True, True), ddp[0]
        _compare(misc_runs, key)


def test_ignored_output(misc_runs: Runs) -> None:
    """Ported from ``test_ignored_output`` and ``test_ignored_output_with_unused_parameters``
    (test/distributed/test_c10d_gloo.py): outputs thrown away without backward, then ordinary
    steps (find_unused_parameters False, and True with an unused layer): no error, DDP's
    gradients."""
    for flag in (False, True):
        _ok(_ddp(misc_runs, f"ignored_output/{flag}"), "DDP ignored_output")
        _compare(misc_runs, f"ignored_output/{flag}")


def test_global_local_unused_params_grad(misc_runs: Runs) -> None:
    """Ported from ``test_global_local_unused_params_grad`` and its ``_with_grad_is_view``
    variant (test/distributed/test_c10d_gloo.py): rank 0 uses ``t0``, rank 1 ``t1``, nobody
    ``task_unused``: the locally unused parameters get the averaged gradient, the globally
    unused one keeps ``None``; DDP's gradients."""
    for lean in (False, True):
        key = f"global_local/{lean}"
        ddp = _ddp(misc_runs, key)
        _ok(ddp, f"DDP {key}")
        assert ddp[0]["task_unused.weight"] is None and ddp[0]["t1.weight"] is not None
        _compare(misc_runs, key)
