"""Uneven inputs: ``DataParallel.join()`` and torch's ``Join([model, ...])`` behave as DDP's.

Each scenario runs on gloo ranks with as many batches per rank as its table says, once with
torch's DistributedDataParallel under ``join()`` and once with syncline's DataParallel, and
compares every gradient each rank sees, the final parameters and buffers, and how far each
rank got, bit for bit. The scenarios are those of PyTorch's own join tests
(torch/testing/_internal/distributed/distributed_test.py: ``test_ddp_uneven_inputs``,
``test_ddp_grad_div_uneven_inputs``, ``test_ddp_uneven_input_join_disable``,
``test_ddp_uneven_inputs_stop_iteration_sync_bn``,
``test_ddp_join_respects_forward_sync_buffers_false``), shrunk to CPU sizes.
"""

from __future__ import annotations

import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from syncline import DataParallel
from syncline.comm import HierarchicalAllreduce, Topology
from syncline.dp import build_compressor
from syncline.errors import ConfigError
from syncline.hooks import HookState, hook
from syncline.testing import run_ranks

KINDS = ("ddp", "syncline")

#: syncline's bucket tuning, fast: each candidate one step, both phases, while a rank is joined
QUICK_TUNING = {
    "autotune_buckets": True,
    "tune_steps_per_trial": 1,
    "tune_rounds": 1,
    "tune_final_rounds": 1,
    "tune_keep_margin": 1e6,
    "tune_min_bucket_mb": 0.00005,
}


@dataclass(frozen=True)
class Case:
    """One scenario: the model, each rank's number of batches, how the join is entered."""

    model: str = "mlp"
    batches: tuple[int, ...] = (5, 3)
    how: str = "method"  # model.join(...), or "Join" ([model]) or "Join+zero" ([model, ZeRO])
    join: dict[str, Any] = field(default_factory=dict)  # model.join's / Join's arguments
    wrap: dict[str, Any] = field(default_factory=dict)  # both wrappers' arguments
    ours: dict[str, Any] = field(default_factory=dict)  # DataParallel's own arguments
    compressor: str | None = None  # DataParallel's; DDP gets it as syncline's comm hook
    sync_every: int = 1  # the other steps run under no_sync()
    same_data: bool = False  # every rank draws the same batches (else its own)
    evaluate: bool = False  # a forward under no_grad before each step (DDP cannot: see below)


CASES: dict[str, Case] = {
    "plain": Case(),
    # rank 0 never trains: it shadows the first step's bucket-order broadcast too
    "a rank with no batch": Case(batches=(0, 4)),
    "Join([model])": Case(how="Join"),
    "Join([model, ZeroRedundancyOptimizer])": Case(how="Join+zero"),
    "BatchNorm, buffers synchronised": Case(model="bn"),
    "BatchNorm, forward_sync_buffers=False": Case(
        model="bn", batches=(2, 4), wrap={"forward_sync_buffers": False}
    ),
    "divide_by_initial_world_size=False": Case(join={"divide_by_initial_world_size": False}),
    "no_sync every other step": Case(batches=(6, 3), sync_every=2),
    "find_unused_parameters, unused on the rank that joins": Case(
        model="unused-on-1", batches=(5, 2), wrap={"find_unused_parameters": True}
    ),
    "find_unused_parameters, unused on the rank still training": Case(
        model="unused-on-0", batches=(5, 2), wrap={"find_unused_parameters": True}
    ),
    "sparse gradients": Case(model="sparse"),
    "bucket tuning decided while a rank is joined": Case(batches=(9, 2), ours=QUICK_TUNING),
    "several buckets": Case(wrap={"bucket_cap_mb": 0.0001}),
    "fp16 compression": Case(compressor="fp16", wrap={"bucket_cap_mb": 0.0001}),
    "bf16 compression": Case(compressor="bf16"),
    "enable=False, even inputs": Case(batches=(4, 4), join={"enable": False}),
    "an evaluation forward before each step": Case(evaluate=True),
}
#: scenarios DDP cannot run, and the one whose DDP results they must give: under join, DDP's
#: forward under no_grad tells the joined ranks a backward follows (it sends
#: require_backward_grad_sync), so they wait for buckets that never come
LIKE = {"an evaluation forward before each step": "plain"}


class UnusedOnRank(nn.Module):
    """Two layers; on rank ``skip`` the first is not used (torch's ``UnusedParamModule``)."""

    def __init__(self, skip: int) -> None:
        super().__init__()
        self.skip = skip
        self.t0 = nn.Linear(6, 6)
        self.t1 = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.t1(x if dist.get_rank() == self.skip else torch.tanh(self.t0(x)))


class SparseNet(nn.Module):
    """An ``EmbeddingBag(sparse=True)`` (reduced on its own, sparse) beside dense layers."""

    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(10, 6, sparse=True)
        self.out = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx = (x[:, :3].abs() * 10).long().clamp(max=9)
        return self.out(self.bag(idx))


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "bn":
        return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))
    if name.startswith("unused-on-"):
        return UnusedOnRank(int(name[-1]))
    if name == "sparse":
        return SparseNet()
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _wrap(kind: str, model: nn.Module, case: Case) -> nn.Module:
    with warnings.catch_warnings():  # DDP 2.13: broadcast_buffers is deprecated
        warnings.simplefilter("ignore", FutureWarning)
        if kind == "ddp":
            ddp = DDP(model, **case.wrap)
            if case.compressor is not None:
                ddp.register_comm_hook(HookState(build_compressor(case.compressor)), hook)
            return ddp
        comp = None if case.compressor is None else build_compressor(case.compressor)
        return DataParallel(model, compression=comp, **case.wrap, **case.ours)


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {
        n: None if p.grad is None else p.grad.detach().to_dense().clone()
        for n, p in model.named_parameters()
    }


def _context(case: Case, wrapped: nn.Module, opt: Any) -> Any:
    if case.how == "method":
        return wrapped.join(**case.join)
    joinables = [wrapped, opt] if case.how == "Join+zero" else [wrapped]
    kwargs = dict(case.join)
    return Join(joinables, kwargs.pop("enable", True), kwargs.pop("throw", False), **kwargs)


def _optimizer(case: Case, model: nn.Module) -> Any:
    if case.how == "Join+zero":
        return ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1, momentum=0.9
        )
    if case.model in ("sparse", "unused-on-0"):  # no momentum: see UNUSED_WHILE_JOINED
        return torch.optim.SGD(model.parameters(), lr=0.1)
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _run_case(rank: int, kind: str, case: Case) -> dict[str, Any]:
    model = _model(case.model)
    wrapped = _wrap(kind, model, case)
    opt = _optimizer(case, model)
    gen = torch.Generator().manual_seed(100 + (0 if case.same_data else rank))
    grads, done = [], 0
    with _context(case, wrapped, opt):
        for i in range(case.batches[rank]):
            x, y = torch.randn(4, 6, generator=gen), torch.randn(4, 3, generator=gen)
            if case.evaluate:
                with torch.no_grad():
                    wrapped(x)
            with nullcontext() if i % case.sync_every == case.sync_every - 1 else wrapped.no_sync():
                nn.functional.mse_loss(wrapped(x), y).backward()
            grads.append(_grads(model))
            if i % case.sync_every == case.sync_every - 1:
                opt.step()
                opt.zero_grad(set_to_none=True)
            done += 1
    out = {
        "grads": grads,
        "done": done,
        "state": {k: v.clone() for k, v in model.state_dict().items()},
    }
    if kind == "syncline":
        out["tuning"] = wrapped.bucket_tuning
    return out


def _cases_rank(rank: int, world: int, kind: str) -> dict[str, Any]:
    del world
    return {
        name: _run_case(rank, kind, case)
        for name, case in CASES.items()
        if kind == "syncline" or name not in LIKE
    }


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict[str, Any]]]:
    return {
        kind: run_ranks(_cases_rank, 2, kind, timeout_s=240, comm_timeout_s=30) for kind in KINDS
    }


def _assert_same(got: Any, want: Any, where: str) -> None:
    if isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for k in want:
            _assert_same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_same(g, w, f"{where}[{i}]")
    elif isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and torch.equal(got, want), (where, got, want)
    else:
        assert got == want, (where, got, want)


#: [Note: unused while a rank is joined] With find_unused_parameters, a parameter that no
#: rank still training uses keeps its gradient under DataParallel (None stays None), as when
#: no rank uses it without join. DDP's joined rank sends, instead of its (empty) use of the
#: parameters, the reduced map of its own last step (``_get_local_used_map`` returns the
#: device map the last allreduce wrote), so a parameter any rank used in that step counts as
#: used and gets a zero gradient. Different on purpose; without momentum (a zero gradient
#: then moves nothing) the weights are DDP's bit for bit.
UNUSED_WHILE_JOINED = "find_unused_parameters, unused on the rank still training"


def _ddp_expected(runs: dict[str, Any], name: str, rank: int) -> dict[str, Any]:
    want = runs["ddp"][rank][LIKE.get(name, name)]
    if name != UNUSED_WHILE_JOINED or rank != 0:
        return want
    grads = [dict(g) for g in want["grads"]]
    for step in range(CASES[name].batches[1], len(grads)):  # rank 1 joined, rank 0 skips t0
        for key in ("t0.weight", "t0.bias"):
            assert grads[step][key] is not None and not grads[step][key].any()  # DDP: zeros
            grads[step][key] = None  # DataParallel: unused by every rank still training
    return {**want, "grads": grads}


@pytest.mark.parametrize("name", list(CASES))
def test_uneven_inputs_train_as_under_ddp_join(runs: dict[str, Any], name: str) -> None:
    """Every gradient, the final parameters and buffers, on every rank: DDP's, bit for bit
    (but see [Note: unused while a rank is joined])."""
    for rank in range(2):
        ours, ddp = runs["syncline"][rank][name], _ddp_expected(runs, name, rank)
        assert ours["done"] == CASES[name].batches[rank]
        _assert_same({k: v for k, v in ours.items() if k != "tuning"}, ddp, f"rank {rank} {name}")
    # after the join, every rank holds the same model (sent from the last to join)
    if CASES[name].wrap.get("forward_sync_buffers") is False:
        first, second = (runs["syncline"][r][name]["state"] for r in range(2))
        assert not torch.equal(first["1.running_mean"], second["1.running_mean"])
    else:
        _assert_same(runs["syncline"][0][name]["state"], runs["syncline"][1][name]["state"], name)


def test_bucket_tuning_is_decided_while_a_rank_is_joined(runs: dict[str, Any]) -> None:
    """The tuning's measurement rounds (an allgather each) ran while rank 1 was joined: its
    shadow took part, and both ranks adopted the same plan."""
    name = "bucket tuning decided while a rank is joined"
    tuning = [runs["syncline"][rank][name]["tuning"] for rank in range(2)]
    assert tuning[0] is not None and tuning[0] == tuning[1]
    assert len(tuning[0]["candidates"]) >= 2  # cut differently: the bucket count changed
    assert tuning[0]["decided_at"] >= CASES[name].batches[1]


# -- throw_on_early_termination ------------------------------------------------------------------


def _throw_rank(rank: int, world: int, kind: str, how: str) -> dict[str, Any]:
    """Ported from ``test_ddp_uneven_inputs_stop_iteration_sync_bn``: every rank raises once
    the first one runs out of batches; all stop after the same number of steps."""
    del world
    case = Case(model="bn")
    model = _model(case.model)
    wrapped = _wrap(kind, model, case)
    opt = _optimizer(case, model)
    gen = torch.Generator().manual_seed(100 + rank)
    done = 0
    context = (
        wrapped.join(throw_on_early_termination=True)
        if how == "method"
        else Join([wrapped], throw_on_early_termination=True)
    )
    try:
        with context:
            for _ in range((5, 3)[rank]):
                x, y = torch.randn(4, 6, generator=gen), torch.randn(4, 3, generator=gen)
                nn.functional.mse_loss(wrapped(x), y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                done += 1
    except Exception as exc:  # the kind of error is the result
        error = (type(exc).__name__, str(exc))
    else:
        error = ("none", "")
    return {"error": error, "done": done, "state": model.state_dict()}


@pytest.mark.parametrize("how", ["method", "Join"])
def test_throw_on_early_termination_raises_on_every_rank_as_ddp(how: str) -> None:
    ddp = run_ranks(_throw_rank, 2, "ddp", how, timeout_s=120, comm_timeout_s=30)
    ours = run_ranks(_throw_rank, 2, "syncline", how, timeout_s=120, comm_timeout_s=30)
    assert (
        ours[0]["error"]
        == ddp[0]["error"]
        == (
            "RuntimeError",
            "Detected at least one rank that exhausted inputs. Throwing across all ranks.",
        )
    )
    assert ours[1]["error"] == ddp[1]["error"] == ("RuntimeError", "Rank 1 exhausted all inputs.")
    for rank in range(2):
        assert ours[rank]["done"] == ddp[rank]["done"] == 3
        _assert_same(ours[rank]["state"], ddp[rank]["state"], f"rank {rank}")


# -- refused, and disabled -----------------------------------------------------------------------


class _Counted:
    """Counts the collectives issued (a spy around torch.distributed's own functions)."""

    NAMES = ("all_reduce", "all_gather", "broadcast", "reduce_scatter_tensor")

    def __init__(self) -> None:
        self.calls = 0
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> _Counted:
        for name in self.NAMES:
            real = getattr(dist, name)
            self._saved[name] = real

            def spy(*args: Any, _real: Any = real, **kwargs: Any) -> Any:
                self.calls += 1
                return _real(*args, **kwargs)

            setattr(dist, name, spy)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, real in self._saved.items():
            setattr(dist, name, real)


def _refused_rank(rank: int, world: int, compressor: str) -> dict[str, Any]:
    del world
    model = _model("mlp")
    dp = DataParallel(model, compression=build_compressor(compressor))
    errors = []
    with _Counted() as counted:
        for enter in (lambda: dp.join(), lambda: Join([dp])):
            try:
                enter()
            except ConfigError as exc:
                errors.append(str(exc))
    # nothing was left half-done: training on even inputs goes on as usual
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(2):
        x, y = torch.randn(4, 6, generator=gen), torch.randn(4, 3, generator=gen)
        nn.functional.mse_loss(dp(x), y).backward()
    return {"errors": errors, "collectives": counted.calls, "weight": model[0].weight.grad}


@pytest.mark.parametrize("compressor", ["topk:0.1", "csc:0.1", "powersgd:1"])
def test_a_compressor_with_residuals_is_refused_before_any_work(compressor: str) -> None:
    """A rank out of inputs has no gradient to compress: it would send its residuals, not
    zeros. Refused on every rank when the join is set up, before any collective."""
    out = run_ranks(_refused_rank, 2, compressor, timeout_s=120, comm_timeout_s=30)
    for rank in range(2):
        assert len(out[rank]["errors"]) == 2, rank
        for text in out[rank]["errors"]:
            assert f"compressor {compressor.split(':')[0]!r}" in text
            assert "stateless compressor" in text and "DistributedSampler" in text
        assert out[rank]["collectives"] == 0
    assert torch.equal(out[0]["weight"], out[1]["weight"])


def _disabled_rank(rank: int, world: int) -> dict[str, Any]:
    """Ported from ``test_ddp_uneven_input_join_disable``: ``enable=False`` on even inputs
    is no join: the same collectives (none of the join's) and the same gradients."""
    del world
    out: dict[str, Any] = {}
    for how in ("no join", "enable=False", "Join enable=False"):
        model = _model("bn")
        dp = DataParallel(model)
        gen = torch.Generator().manual_seed(100 + rank)
        context = {
            "no join": nullcontext(),
            "enable=False": dp.join(enable=False),
            "Join enable=False": Join([dp], enable=False),
        }[how]
        grads = []
        with _Counted() as counted, context:
            for _ in range(3):
                x, y = torch.randn(4, 6, generator=gen), torch.randn(4, 3, generator=gen)
                nn.functional.mse_loss(dp(x), y).backward()
                grads.append(_grads(model))
        out[how] = {"grads": grads, "collectives": counted.calls, "state": model.state_dict()}
    return out


def test_enable_false_is_no_join() -> None:
    out = run_ranks(_disabled_rank, 2, timeout_s=120, comm_timeout_s=30)
    for rank in range(2):
        want = out[rank]["no join"]
        for how in ("enable=False", "Join enable=False"):
            _assert_same(out[rank][how], want, f"rank {rank} {how}")


# -- three ranks ---------------------------------------------------------------------------------


def _three_rank(rank: int, world: int, kind: str, divide: bool) -> dict[str, Any]:
    del world
    case = Case(batches=(5, 2, 4), join={"divide_by_initial_world_size": divide}, same_data=True)
    return _run_case(rank, kind, case)


@pytest.mark.parametrize("divide", [True, False])
def test_three_ranks_joining_at_different_steps(divide: bool) -> None:
    """Ranks 1 and 2 run out at different steps; with ``divide_by_initial_world_size=False``
    each step is divided by the ranks still training (3, 3, 2, 2, 1), as DDP.

    Every rank draws the same batches, as in torch's ``test_ddp_grad_div_uneven_inputs``: a
    sum of three different values depends on the order the allreduce adds them in, which
    the bucket layout decides (DDP's and DataParallel's differ); a sum of equal ones and
    zeros does not, so the comparison stays bit for bit."""
    ddp = run_ranks(_three_rank, 3, "ddp", divide, timeout_s=120, comm_timeout_s=30)
    ours = run_ranks(_three_rank, 3, "syncline", divide, timeout_s=120, comm_timeout_s=30)
    for rank in range(3):
        got = {k: v for k, v in ours[rank].items() if k != "tuning"}
        _assert_same(got, ddp[rank], f"rank {rank}")


def _hierarchical_rank(rank: int, world: int, hierarchical: bool) -> dict[str, Any]:
    case = Case(model="bn", batches=(5, 3, 4, 2), same_data=True, wrap={"bucket_cap_mb": 0.0001})
    if hierarchical:
        topology = Topology(world, 2)
        case.ours["allreduce"] = HierarchicalAllreduce(topology, timeout_s=30).build()
    return _run_case(rank, "syncline", case)


def test_a_hierarchical_allreduce_is_shadowed_too() -> None:
    """4 ranks on 2 nodes, each joining at its own step: the joined ranks issue each
    bucket's phases (within the node, across nodes) as the others do; the result is the
    flat allreduce's (to rounding: the sums are grouped differently)."""
    hier = run_ranks(_hierarchical_rank, 4, True, timeout_s=180, comm_timeout_s=30)
    flat = run_ranks(_hierarchical_rank, 4, False, timeout_s=180, comm_timeout_s=30)
    for rank in range(4):
        assert hier[rank]["done"] == (5, 3, 4, 2)[rank]
        for got, want in zip(hier[rank]["grads"], flat[rank]["grads"], strict=True):
            for name in want:
                torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7)
        _assert_same(hier[rank]["state"], hier[0]["state"], f"rank {rank}")
