"""Scenarios of PyTorch's own pipelining test suite (test/distributed/pipelining/), ported: each
runs on real gloo ranks once with ``torch.distributed.pipelining`` (``PipelineStage`` built by hand
from the model's split, with ``ScheduleGPipe``, ``Schedule1F1B`` or ``ScheduleInterleaved1F1B``)
and once with syncline's ``Pipeline`` (``"gpipe"``, ``"1f1b"``, ``"interleaved"``) on the same
model, balance, micro-batch count and data, and the two must agree rank by rank: the losses,
the gradients each optimizer step sees and the parameters after it, or the same refusal.

Upstream compares each schedule with the full model in one process; here the peer is the
reference (the house rule: test against the peers' own suites), so any drift of syncline from
torch's pipelines shows, whatever the cause.

Loss-scaling conventions, compared like with like:

- torch's schedules call ``loss_fn`` on each micro-batch, backpropagate it unscaled and, with
  ``scale_grads=True`` (the default), divide the accumulated gradients by m at the end;
  syncline backpropagates ``loss / m`` per micro-batch. With a mean loss both give the
  gradient of the batch mean. For m a power of two, dividing by m is exact in floating point
  and commutes with every rounding of the backward, and both engines accumulate each stage's
  micro-batches in the same order (0..m-1), so the gradients are bitwise equal
  (``torch.equal``); for other m they differ by float32 rounding (see ``CLOSE``).
- upstream's own tests use ``MSELoss(reduction="sum")`` with ``scale_grads=False``: torch's
  gradient is then the batch sum's, m times syncline's (which still divides by m); syncline's
  gradients times m must equal torch's exactly, and syncline trained with ``lr * m`` must take
  exactly torch's steps.
- torch returns each micro-batch's loss on the last stage, syncline the batch's mean on every
  rank: torch's list is reduced with syncline's arithmetic (the float64 sum over m, training;
  the float64 mean, evaluation), so the values must be equal exactly.

The scenarios are batched into one rank function per engine, run on 2 ranks and on 4 (four
process launches for the whole set, as test_ddp_upstream.py batches its own); a scenario that
raises is recorded as ``("error", type name, first line)`` so that one failure does not hide
the others. The micro-batch split and the schedule-order checks at the end run in this
process, the latter on syncline's schedule IR with torch's own checkers.

Left out, because syncline has no counterpart: the tracer front end (``pipeline()``,
``test_grad_with_tracer``, ``test_kwargs_with_tracer``, ``test_stage.py``'s tracer tests:
syncline's traced split has its own tests); zero-bubble, looped-BFS, V-shaped and DualPipeV
schedules, custom stage-to-rank maps (``test_non_symmetric_stage_ids``: syncline places stage
s on rank s % size), custom action runtimes, CSV and lowering passes, ``dw_builder``;
gradients accumulated over several steps without an optimizer step
(``test_schedule_with_native_zero_bubble``: a syncline step always ends with the STEP);
DTensor, torch.compile, block masks, returning the last stage's outputs from a training step
(``test_return_output``), pre-split micro-batch arguments, and the per-chunk shape and dtype
checks (torch 2.13 makes them only under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``). syncline's 2BW
has no torch counterpart.
"""

from __future__ import annotations

import itertools
import warnings
from collections import Counter
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    _ScheduleForwardOnly,
)
from torch.distributed.pipelining.microbatch import merge_chunks, split_args_kwargs_into_chunks
from torch.distributed.pipelining.schedules import (
    _Action,
    _add_send_recv,
    _ComputationType,
    _simulate_comms_compute,
    _validate_schedule,
)

from syncline.pipeline import Pipeline
from syncline.pipeline.batches import take_batch
from syncline.schedule import ActionKind, Schedule, ScheduleError, build_plan, validate
from syncline.testing import RankFailure, run_ranks

ENGINES = ("torch", "syncline")
WORLD = 2
D_HID = 16  # the MLP's width (upstream: 512)
ROWS = 4  # samples per micro-batch unless a case says otherwise (upstream: 64 or 256 a batch)
FUNNEL = (16, 32, 8, 24, 5)  # widths of the funnel model: a different shape at every boundary
LR = 0.1
FORWARD_ITERS = 3
# Where the arithmetic differs (m not a power of two: torch divides the accumulated gradient
# by m, syncline each micro-batch's loss before the backward), the results differ by float32
# rounding: observed |diff| <= 1.5e-8 on gradients whose largest entries are ~0.1 (1-2 ulps
# there; float32's eps is 1.2e-7), and the same on the parameters after the step. rtol 1e-6
# (~8 ulps) bounds the relative error; atol 1e-7 (~13 ulps at 0.1) covers entries that cancel
# to near zero, which keep the absolute rounding error of their larger summands.
CLOSE = {"rtol": 1e-6, "atol": 1e-7}

Result = dict[str, Any]
Runs = dict[str, Any]

# -- the scenarios ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One scenario, run alike by both engines on the ranks of its group of cases.

    ``balance``: blocks per stage (``len(balance)`` stages; stage ``s`` on rank ``s % ranks``).
    ``mode``: ``"train"`` (``steps`` optimizer steps), ``"eval"`` (an evaluation, then a
    training step on the same batch), ``"forward"`` (forward only, the output fed back in
    ``FORWARD_ITERS`` times), ``"single"`` (the whole model as one stage on a one-rank group
    per rank), ``"uneven"`` (syncline gets a batch that does not split into m between two
    good batches; torch only the good ones).
    """

    schedule: str
    m: int
    balance: tuple[int, ...] = (1, 1)
    model: str = "mlp"  # "mlp": blocks of D_HID; "funnel": the FUNNEL widths, 5 classes
    loss: str = "mse"  # "mse" (mean), "mse_sum" (upstream's), "ce" (class targets)
    steps: int = 2
    momentum: float = 0.0
    mode: str = "train"
    batch: int | None = None  # None: ROWS * m

    @property
    def stages(self) -> int:
        return len(self.balance)

    @property
    def size(self) -> int:
        return self.batch if self.batch is not None else ROWS * self.m


INTERLEAVED = (1, 1, 1, 1)  # 4 stages on 2 ranks


def _split(schedule: str) -> tuple[int, ...]:
    """One block per stage: 2 stages, or 4 (two per rank) for the interleaved schedule."""
    return INTERLEAVED if schedule == "interleaved" else (1, 1)


CASES: dict[str, Case] = {
    # test_grad_with_manual: m < stages (GPipe only), m == stages, m > stages, m not 2^k
    **{f"manual/{s}/m{m}": Case(s, m) for s in ("gpipe", "1f1b") for m in (1, 2, 3, 4)},
    # test_grad_with_manual_interleaved, and the flexible micro-batch counts of torch's
    # ScheduleInterleaved1F1B (m % rounds == 0, rounds = max(1, m // ranks))
    **{f"interleaved/m{m}": Case("interleaved", m, INTERLEAVED) for m in (1, 2, 3, 4, 5, 6)},
    # test_multi_iter: several steps in a row (SGD with momentum, so errors would compound)
    **{
        f"iters/{s}": Case(s, 4, _split(s), steps=4, momentum=0.9)
        for s in ("gpipe", "1f1b", "interleaved")
    },
    # upstream's loss convention: MSELoss(reduction="sum") with scale_grads=False
    **{f"sum/{s}": Case(s, 4, _split(s), loss="mse_sum") for s in ("gpipe", "1f1b", "interleaved")},
    # a loss with class targets on the last stage; the activations change shape at each boundary
    "funnel/gpipe": Case("gpipe", 4, (3, 1), model="funnel", loss="ce"),
    "funnel/1f1b": Case("1f1b", 4, (1, 3), model="funnel", loss="ce"),
    "funnel/interleaved": Case("interleaved", 4, INTERLEAVED, model="funnel", loss="ce"),
    # test_eval_inference_mode and test_schedule_eval_then_train
    **{f"eval/{s}": Case(s, 4, _split(s), mode="eval") for s in ("gpipe", "1f1b", "interleaved")},
    # test_forward_only
    "forward": Case("gpipe", 4, mode="forward"),
    # test_schedule_with_single_stage (cross-entropy, as upstream)
    **{
        f"single/{s}": Case(s, 2, (4,), model="funnel", loss="ce", mode="single")
        for s in ("gpipe", "1f1b", "interleaved")
    },
    # more micro-batches than samples: both must refuse
    "refuse/too-many-microbatches": Case("gpipe", 8, batch=4, steps=1),
    # test_stage.py's wrong batch size: syncline must refuse it before any work
    "uneven": Case("1f1b", 4, mode="uneven"),
}

# On 4 ranks (upstream's world size): middle stages, which receive and send both ways, a
# deeper 1F1B warm-up, and 8 interleaved stages (upstream's 2 per rank).
WORLD4 = 4
CASES4: dict[str, Case] = {
    **{f"w4/manual/{s}/m{m}": Case(s, m, (1,) * 4) for s in ("gpipe", "1f1b") for m in (4, 8)},
    "w4/manual/gpipe/m2": Case("gpipe", 2, (1,) * 4),
    **{f"w4/interleaved/m{m}": Case("interleaved", m, (1,) * 8) for m in (4, 8)},
    "w4/eval/1f1b": Case("1f1b", 4, (1,) * 4, mode="eval"),
}
ALL_CASES = {**CASES, **CASES4}

# -- helpers (run inside the ranks) -------------------------------------------------------------


class Block(nn.Module):
    """Linear, ReLU, Linear: one layer of upstream's MLP test model, in our own code."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.inner = nn.Linear(d_in, d_out)
        self.outer = nn.Linear(d_out, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(torch.relu(self.inner(x)))


def _model(case: Case) -> nn.Sequential:
    """The full model, the same on every rank and for both engines (seed 0)."""
    torch.manual_seed(0)
    if case.model == "funnel":
        assert sum(case.balance) == len(FUNNEL) - 1
        return nn.Sequential(*[Block(a, b) for a, b in itertools.pairwise(FUNNEL)])
    return nn.Sequential(*[Block(D_HID, D_HID) for _ in range(sum(case.balance))])


def _loss(case: Case) -> nn.Module:
    if case.loss == "ce":
        return nn.CrossEntropyLoss()
    return nn.MSELoss(reduction="sum" if case.loss == "mse_sum" else "mean")


def _batch(case: Case, step: int, size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``step`` of ``case`` (``size`` samples instead of the case's, for a bad batch)."""
    n = case.size if size is None else size
    g = torch.Generator().manual_seed(1000 + step)
    d_in = FUNNEL[0] if case.model == "funnel" else D_HID
    x = torch.randn(n, d_in, generator=g)
    if case.loss == "ce":
        return x, torch.randint(0, FUNNEL[-1], (n,), generator=g)
    return x, torch.randn(n, D_HID, generator=g)


def _bounds(balance: tuple[int, ...]) -> list[tuple[int, int]]:
    out, lo = [], 0
    for n in balance:
        out.append((lo, lo + n))
        lo += n
    return out


def _attempt(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn``'s result, or ``("error", type name, first line)`` if it raised."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn(*args)
    except Exception as exc:  # the kind of error is the result
        lines = str(exc).strip().splitlines()
        return ("error", type(exc).__name__, lines[0] if lines else "")


class Recording(torch.optim.SGD):
    """SGD that records, at each step, the gradients it applies, by full-model name, into
    ``log`` (both engines' optimizers step the same layer objects, those of the full model)."""

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        names: dict[int, str],
        log: dict[str, torch.Tensor],
        **kwargs: Any,
    ) -> None:
        super().__init__(params, **kwargs)
        self._names, self._log = names, log

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._log[self._names[id(p)]] = p.grad.detach().clone()
        return super().step(closure)


OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class TorchRunner:
    """The rank's stages under torch.distributed.pipelining, built by hand from the split."""

    def __init__(
        self, case: Case, full: nn.Sequential, rank: int, size: int, group: Any,
        optimizer: OptimizerFactory,
    ) -> None:  # fmt: skip
        mine = [s for s in range(case.stages) if s % size == rank]
        bounds = _bounds(case.balance)
        parts = {s: nn.Sequential(*[full[i] for i in range(*bounds[s])]) for s in mine}
        cpu = torch.device("cpu")
        stages = [PipelineStage(parts[s], s, case.stages, cpu, group=group) for s in mine]
        self.first, self.last, self.m, self.size = 0 in mine, case.stages - 1 in mine, case.m, size
        loss = {"loss_fn": _loss(case), "scale_grads": case.loss != "mse_sum"}
        if case.mode == "forward":
            self.schedule: Any = _ScheduleForwardOnly(stages[0], case.m, scale_grads=False)
        elif case.schedule == "interleaved":
            self.schedule = ScheduleInterleaved1F1B(stages, case.m, **loss)
        else:
            cls = ScheduleGPipe if case.schedule == "gpipe" else Schedule1F1B
            self.schedule = cls(stages[0], case.m, **loss)
        self.optimizers = [optimizer(parts[s].parameters()) for s in mine]

    def _run(self, call: Callable[..., Any], x: torch.Tensor, y: torch.Tensor) -> list[float]:
        losses: list[torch.Tensor] = []
        args = (x,) if self.first else ()
        kwargs = {"target": y, "losses": losses} if self.last else {}
        with torch.no_grad() if self.first and call == self.schedule.eval else nullcontext():
            call(*args, **kwargs)  # upstream evaluates the first stage under no_grad
        return [float(v.detach()) for v in losses]

    def train(self, x: torch.Tensor, y: torch.Tensor) -> float | None:
        losses = self._run(self.schedule.step, x, y)
        for opt in self.optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        # syncline's arithmetic: the float64 sum of the micro-batch losses, divided by m
        return sum(losses) / self.m if self.last else None

    def eval(self, x: torch.Tensor, y: torch.Tensor) -> float | None:
        losses = self._run(self.schedule.eval, x, y)
        # syncline's evaluation arithmetic: the float64 mean of the micro-batch losses
        return float(torch.tensor(losses, dtype=torch.float64).mean()) if self.last else None

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """As upstream's test_forward_only: the last rank sends the output back to rank 0."""
        last = self.size - 1
        if self.first:
            self.schedule.step(x)
            out = torch.empty_like(x)
            dist.recv(out, src=last)
            return out
        out = self.schedule.step()
        if self.last:
            dist.send(out, dst=0)
        return out


class SynclineRunner:
    """The rank's stages under syncline's Pipeline."""

    def __init__(
        self, case: Case, full: nn.Sequential, rank: int, size: int, group: Any,
        optimizer: OptimizerFactory,
    ) -> None:  # fmt: skip
        del rank, size
        self.pipe = Pipeline(
            full, num_stages=case.stages, num_microbatches=case.m, schedule=case.schedule,
            loss_fn=_loss(case), optimizer=optimizer, balance=list(case.balance),
            process_group=group, timeout_s=30,
        )  # fmt: skip

    def train(self, x: torch.Tensor, y: torch.Tensor) -> float:
        return self.pipe.train_step(iter([(x, y)]))

    def eval(self, x: torch.Tensor, y: torch.Tensor) -> float:
        return self.pipe.eval_step(iter([(x, y)]))

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        return self.pipe.predict(x)


def _layers(case: Case, rank: int, size: int) -> list[int]:
    bounds = _bounds(case.balance)
    return [i for s in range(case.stages) if s % size == rank for i in range(*bounds[s])]


def _params(full: nn.Sequential, layers: list[int]) -> dict[str, torch.Tensor]:
    return {f"{i}.{n}": p.detach().clone() for i in layers for n, p in full[i].named_parameters()}


def _with_grad(full: nn.Sequential, layers: list[int]) -> list[str]:
    return [f"{i}.{n}" for i in layers for n, p in full[i].named_parameters() if p.grad is not None]


def _scenario(engine: str, rank: int, world: int, case: Case, group: Any) -> Result:
    """Run ``case`` with ``engine`` on this rank; what the tests compare."""
    size, rank_in = (1, 0) if case.mode == "single" else (world, rank)
    full = _model(case)
    names = {id(p): n for n, p in full.named_parameters()}
    log: dict[str, torch.Tensor] = {}
    lr = LR
    if engine == "syncline" and case.loss == "mse_sum":
        lr = LR * case.m  # syncline's gradient of a summed loss is torch's divided by m

    def optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return Recording(params, names, log, lr=lr, momentum=case.momentum)

    cls = TorchRunner if engine == "torch" else SynclineRunner
    runner = cls(case, full, rank_in, size, group, optimizer)
    layers = _layers(case, rank_in, size)
    out: Result = {"losses": [], "grads": []}
    if case.mode == "forward":
        x = _batch(case, 0)[0]
        for _ in range(FORWARD_ITERS):
            x = runner.predict(x)
        out["out"] = x
        return out
    if case.mode == "eval":
        x, y = _batch(case, 0)
        before = _params(full, layers)
        out["eval_loss"] = runner.eval(x, y)
        out["eval_grads"] = _with_grad(full, layers)
        after = _params(full, layers)
        out["eval_kept_weights"] = all(torch.equal(after[k], v) for k, v in before.items())
    steps = 1 if case.mode == "eval" else case.steps  # eval: train on the evaluated batch
    for step in range(steps):
        x, y = _batch(case, step)
        out["losses"].append(runner.train(x, y))
        out["grads"].append(dict(sorted(log.items())))
        log.clear()
        if step == 0 and case.mode == "uneven" and engine == "syncline":
            bad_x, bad_y = _batch(case, 99, size=case.size + 2)  # torch does not refuse it
            out["refusal"] = _attempt(runner.train, bad_x, bad_y)
    out["params"] = _params(full, layers)
    if isinstance(runner, SynclineRunner):
        assert runner.pipe.flush() is None
    return out


def _engine_rank(rank: int, world: int, engine: str, cases: dict[str, Case]) -> Result:
    # a one-rank group for each rank (every rank creates every group, in the same order)
    single = any(case.mode == "single" for case in cases.values())
    own = [dist.new_group([r]) for r in range(world)] if single else []
    out = {}
    for key, case in cases.items():
        group = own[rank] if case.mode == "single" else None
        out[key] = _attempt(_scenario, engine, rank, world, case, group)
        dist.barrier()  # one scenario's messages never meet the next one's
    return out


# -- helpers (run in the test process) ----------------------------------------------------------


def _is_error(value: Any) -> bool:
    return isinstance(value, tuple) and len(value) == 3 and value[0] == "error"


def _assert_same(
    got: Any, want: Any, where: str, close: dict[str, float] | None = None, scale: float = 1.0
) -> None:
    """``got`` (syncline; tensors times ``scale``) is ``want`` (torch): tensors equal exactly
    (within ``close`` if given), everything else equal."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), (where, got)
        assert got.dtype == want.dtype and got.shape == want.shape, (where, got.shape, want.shape)
        g = got * scale if scale != 1.0 else got
        if close is None:
            diff = (g - want).abs().max().item() if g.numel() else 0.0
            assert torch.equal(g, want), f"{where}: syncline != torch (max |diff| {diff:.3g})"
        else:
            torch.testing.assert_close(g, want, **close, msg=lambda m: f"{where}: {m}")
    elif isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(want), (
            f"{where}: keys {sorted(got) if isinstance(got, dict) else got} != {sorted(want)}"
        )
        for key in want:
            _assert_same(got[key], want[key], f"{where}/{key}", close, scale)
    elif isinstance(want, list | tuple):
        assert isinstance(got, list | tuple) and len(got) == len(want), (where, got, want)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_same(g, w, f"{where}[{i}]", close, scale)
    else:
        assert got == want, f"{where}: syncline {got!r} != torch {want!r}"


def _launch(fn: Callable[..., Any], world: int, cases: dict[str, Case]) -> Runs:
    out: Runs = {}
    for engine in ENGINES:
        try:
            out[engine] = run_ranks(fn, world, engine, cases, timeout_s=240, comm_timeout_s=30)
        except RankFailure as exc:  # reported by every test of this launch
            out[engine] = exc
    return out


@pytest.fixture(scope="module")
def runs() -> Runs:
    return _launch(_engine_rank, WORLD, CASES)


@pytest.fixture(scope="module")
def runs4() -> Runs:
    return _launch(_engine_rank, WORLD4, CASES4)


def _ranks(runs: Runs, engine: str) -> list[Result]:
    result = runs[engine]
    if isinstance(result, Exception):
        pytest.fail(f"the {engine} ranks failed: {result}")
    return result


def _result(runs: Runs, engine: str, key: str, rank: int) -> Any:
    return _ranks(runs, engine)[rank][key]


def _ok(value: Any, what: str) -> Result:
    assert not _is_error(value), f"{what}: {value}"
    return value


def _last_loss(runs: Runs, key: str, field: str = "losses") -> Any:
    """torch's value of ``field`` on the rank of the last stage (the only one that has it)."""
    case = ALL_CASES[key]
    world = len(_ranks(runs, "torch"))
    last = 0 if case.mode == "single" else (case.stages - 1) % world
    return _ok(_result(runs, "torch", key, last), f"torch {key}")[field]


def _compare_training(
    runs: Runs,
    key: str,
    *,
    torch_key: str | None = None,
    close: dict[str, float] | None = None,
    grad_scale: float = 1.0,
) -> None:
    """syncline's run of ``key`` gave torch's (run of ``torch_key``) on every rank: the loss of
    every step (on every rank), the gradients every step applied and the final parameters."""
    want_key = torch_key or key
    want_losses = _last_loss(runs, want_key)
    for rank in range(len(_ranks(runs, "torch"))):
        want = _ok(_result(runs, "torch", want_key, rank), f"torch rank {rank} {want_key}")
        got = _ok(_result(runs, "syncline", key, rank), f"syncline rank {rank} {key}")
        where = f"rank {rank} {key}"
        assert want["grads"] and all(want["grads"]), f"{where}: torch applied no gradient"
        _assert_same(got["grads"], want["grads"], f"{where} grads", close, grad_scale)
        _assert_same(got["params"], want["params"], f"{where} params", close)
        if close is None:
            assert got["losses"] == want_losses, f"{where}: {got['losses']} != {want_losses}"
        else:
            assert got["losses"] == pytest.approx(want_losses, rel=1e-6), where


def _check_eval(runs: Runs, key: str) -> None:
    """After the evaluation ``key``: torch's loss on every rank, no gradient, no weight changed."""
    want_loss = _last_loss(runs, key, "eval_loss")
    assert want_loss is not None
    for rank in range(len(_ranks(runs, "torch"))):
        want = _ok(_result(runs, "torch", key, rank), f"torch {key}")
        got = _ok(_result(runs, "syncline", key, rank), f"syncline {key}")
        assert want["eval_grads"] == [] and want["eval_kept_weights"], want
        assert got["eval_grads"] == [], f"rank {rank}: eval left gradients on {got['eval_grads']}"
        assert got["eval_kept_weights"], f"rank {rank}: eval changed the weights"
        assert got["eval_loss"] == want_loss, (rank, got["eval_loss"], want_loss)


def _check_eval_then_train(runs: Runs, key: str) -> None:
    """The training step after the evaluation ``key`` is torch's, and its loss the evaluation's
    (the same float32 micro-batch losses averaged in float64, in another order)."""
    _compare_training(runs, key)
    for rank in range(len(_ranks(runs, "syncline"))):
        got = _result(runs, "syncline", key, rank)
        assert abs(got["losses"][0] - got["eval_loss"]) <= 1e-12, (rank, got)


def _assert_refused(value: Any, kind: str, *fragments: str) -> None:
    shown = repr(value) if _is_error(value) else "a result (it ran)"
    assert _is_error(value) and value[1] == kind, f"expected a {kind}, got {shown}"
    for fragment in fragments:
        assert fragment in value[2], f"{fragment!r} not in {value[2]!r}"


# -- training: gradients, parameters, losses ---------------------------------------------------


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_grad_with_manual(runs: Runs, schedule: str) -> None:
    """Ported from test_schedule_multiproc.py::ScheduleTest.test_grad_with_manual: an MLP of one
    block per stage, stages built by hand, two steps (each a fresh gradient), m == stages (2)
    and m > stages (4): the same gradients, parameters and losses as torch's, bit for bit."""
    for m in (2, 4):
        _compare_training(runs, f"manual/{schedule}/m{m}")


def test_grad_with_manual_fewer_microbatches_than_stages(runs: Runs) -> None:
    """test_grad_with_manual with m = 1 < stages: torch's GPipe runs it, and so do syncline's
    GPipe and 1F1B (torch's Schedule1F1B refuses m < stages, see below); all three
    compute the same, so syncline's 1F1B is compared with torch's GPipe."""
    _compare_training(runs, "manual/gpipe/m1")
    _compare_training(runs, "manual/1f1b/m1", torch_key="manual/gpipe/m1")


@pytest.mark.parametrize("key", ["manual/gpipe/m3", "manual/1f1b/m3", "interleaved/m6"])
def test_grad_with_manual_microbatches_not_a_power_of_two(runs: Runs, key: str) -> None:
    """test_grad_with_manual with m = 3 (GPipe, 1F1B) and m = 6 (interleaved): only the place
    where the 1/m is applied differs (see ``CLOSE``), so the results agree to float32 rounding.
    """
    _compare_training(runs, key, close=CLOSE)


@pytest.mark.parametrize("m", [2, 4])
def test_grad_with_manual_interleaved(runs: Runs, m: int) -> None:
    """Ported from test_schedule_multiproc.py::ScheduleTest.test_grad_with_manual_interleaved:
    two stages per rank (4 on 2 ranks, stage s on rank s % 2), m == ranks and m == stages:
    torch's ScheduleInterleaved1F1B and syncline's interleaved schedule agree bit for bit."""
    _compare_training(runs, f"interleaved/m{m}")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
def test_multi_iter(runs: Runs, schedule: str) -> None:
    """Ported from test_schedule_multiproc.py::ScheduleTest.test_multi_iter (upstream: 20 steps,
    only that they run): four steps in a row on new batches, SGD with momentum, so any drift
    would compound; every step's loss and gradients and the final parameters equal torch's."""
    _compare_training(runs, f"iters/{schedule}")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
def test_grad_with_summed_loss(runs: Runs, schedule: str) -> None:
    """Upstream's loss convention in test_grad_with_manual (MSELoss(reduction="sum"),
    scale_grads=False, gradients of the batch sum): syncline divides every loss by m, so its
    gradients times m are torch's exactly, and with lr * m it takes torch's steps exactly."""
    _compare_training(runs, f"sum/{schedule}", grad_scale=CASES[f"sum/{schedule}"].m)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
def test_loss_with_class_targets_and_changing_shapes(runs: Runs, schedule: str) -> None:
    """The loss applied on the last stage only, to integer class targets (cross-entropy, as
    test_schedule.py::ScheduleTest.test_schedule_with_single_stage), on a model whose
    activations have another width at each stage boundary (16 -> 32 -> 8 -> 24 -> 5; torch
    infers the shapes at the first step, syncline sends them with each message)."""
    _compare_training(runs, f"funnel/{schedule}")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_grad_with_manual_4_ranks(runs4: Runs, schedule: str) -> None:
    """test_grad_with_manual on upstream's 4 ranks (two middle stages, a 3-deep 1F1B warm-up):
    m == stages (4) and m > stages (8), and m = 2 < stages for GPipe, bit for bit."""
    for m in (4, 8):
        _compare_training(runs4, f"w4/manual/{schedule}/m{m}")
    if schedule == "gpipe":
        _compare_training(runs4, "w4/manual/gpipe/m2")


@pytest.mark.parametrize("m", [4, 8])
def test_grad_with_manual_interleaved_4_ranks(runs4: Runs, m: int) -> None:
    """test_grad_with_manual_interleaved on upstream's 4 ranks: 8 stages, two per rank,
    m == ranks and m == stages, bit for bit."""
    _compare_training(runs4, f"w4/interleaved/m{m}")


def test_eval_then_train_4_ranks(runs4: Runs) -> None:
    """test_eval_inference_mode and test_schedule_eval_then_train on 4 ranks (1F1B)."""
    _check_eval(runs4, "w4/eval/1f1b")
    _check_eval_then_train(runs4, "w4/eval/1f1b")


# -- evaluation and forward only ---------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
def test_eval_inference_mode(runs: Runs, schedule: str) -> None:
    """Ported from test_schedule_multiproc.py::ScheduleTest.test_eval_inference_mode: an
    evaluation (torch's ``schedule.eval``, syncline's ``eval_step``; the first stage under
    ``no_grad``, as upstream) computes the loss, leaves no gradient and no weight changed."""
    _check_eval(runs, f"eval/{schedule}")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
def test_schedule_eval_then_train(runs: Runs, schedule: str) -> None:
    """Ported from test_schedule.py::ScheduleTest.test_schedule_eval_then_train: a training step
    after an evaluation of the same batch trains as if the evaluation had not happened (torch's
    gradients, parameters and loss) and its loss is the evaluation's (the same micro-batch
    losses, averaged in another order in float64)."""
    _check_eval_then_train(runs, f"eval/{schedule}")


def test_forward_only(runs: Runs) -> None:
    """Ported from test_schedule_multiproc.py::ScheduleTest.test_forward_only: the output fed
    back as the next input ``FORWARD_ITERS`` times (torch: ``_ScheduleForwardOnly``, the last
    rank sending the output to rank 0; syncline: ``predict``, which every rank returns)."""
    want = _ok(_result(runs, "torch", "forward", WORLD - 1), "torch forward")["out"]
    for rank in range(WORLD):
        got = _ok(_result(runs, "syncline", "forward", rank), f"syncline rank {rank}")["out"]
        _assert_same(got, want, f"rank {rank} forward output")
    assert not torch.equal(want, _batch(CASES["forward"], 0)[0])


# -- a single stage ----------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_schedule_with_single_stage(runs: Runs, schedule: str) -> None:
    """Ported from test_schedule.py::ScheduleTest.test_schedule_with_single_stage: the whole
    model as one stage on a one-rank group (each rank runs its own), cross-entropy, two steps:
    torch's gradients, parameters and losses exactly."""
    _compare_training(runs, f"single/{schedule}")


def test_schedule_with_single_stage_interleaved_is_refused_where_torch_trains(runs: Runs) -> None:
    """test_schedule.py::ScheduleTest.test_schedule_with_single_stage with
    ScheduleInterleaved1F1B. A documented difference: torch runs one stage on one rank as an
    "interleaved" schedule; syncline's interleaved schedule needs a group of >= 2 ranks with
    num_stages a multiple >= 2 of it and refuses anything else with a ConfigError before any
    work (the single stage trains under "gpipe" or "1f1b", tested above)."""
    for rank in range(WORLD):
        _ok(_result(runs, "torch", "single/interleaved", rank), "torch single/interleaved")
        _assert_refused(
            _result(runs, "syncline", "single/interleaved", rank), "ConfigError", "1 rank"
        )


# -- micro-batch counts and batch sizes --------------------------------------------------------


def test_interleaved_microbatches_refused_by_both(runs: Runs) -> None:
    """m = 5 on 2 ranks: torch's ScheduleInterleaved1F1B refuses it (m must be a multiple of its
    rounds, max(1, m // ranks) = 2) with a ValueError, syncline (m must be a multiple of the
    ranks) with a ConfigError naming num_microbatches=5, each on every rank, at construction."""
    for rank in range(WORLD):
        _assert_refused(_result(runs, "torch", "interleaved/m5", rank), "ValueError", "5")
        _assert_refused(
            _result(runs, "syncline", "interleaved/m5", rank), "ConfigError", "num_microbatches=5"
        )


@pytest.mark.parametrize("m", [1, 3])
def test_interleaved_microbatches_not_a_multiple_of_ranks(runs: Runs, m: int) -> None:
    """test_schedule.py::TestSchedulePlan's rows with m not a multiple of the group size. A
    documented difference: torch's ScheduleInterleaved1F1B trains on them (it needs only
    m % max(1, m // ranks) == 0); syncline's interleaved schedule needs m to be a multiple of
    the ranks and refuses other m with a ConfigError naming the value, on every rank, before
    any work."""
    key = f"interleaved/m{m}"
    for rank in range(WORLD):
        _ok(_result(runs, "torch", key, rank), f"torch {key}")
        _assert_refused(
            _result(runs, "syncline", key, rank), "ConfigError", f"num_microbatches={m}"
        )


def test_1f1b_with_fewer_microbatches_than_stages_trains_where_torch_refuses(runs: Runs) -> None:
    """A documented difference: torch's Schedule1F1B refuses m = 1 < 2 stages with a
    ValueError; syncline's 1F1B accepts it and then computes what GPipe does (its steady
    state is empty), checked against torch's GPipe in
    test_grad_with_manual_fewer_microbatches_than_stages."""
    for rank in range(WORLD):
        _assert_refused(_result(runs, "torch", "manual/1f1b/m1", rank), "ValueError", "(1)")
        _ok(_result(runs, "syncline", "manual/1f1b/m1", rank), "syncline manual/1f1b/m1")


def test_more_microbatches_than_samples_refused(runs: Runs) -> None:
    """A batch of 4 samples for m = 8: torch refuses it on every rank (rank 0: "Expecting 8
    arg_mbs but got 4", the last: its targets are "smaller than num_chunks"); syncline refuses
    it on every rank with a ConfigError naming both numbers, before any message."""
    key = "refuse/too-many-microbatches"
    for rank in range(WORLD):
        want = _result(runs, "torch", key, rank)
        assert _is_error(want) and want[1] in ("ValueError", "AssertionError"), want
        _assert_refused(
            _result(runs, "syncline", key, rank), "ConfigError", "4 samples", "num_microbatches=8"
        )


def test_batch_not_divisible_refused_before_any_work(runs: Runs) -> None:
    """Ported from test_stage.py::StageTest.test_manual (a batch of another size than the
    micro-batches were built for is refused): syncline refuses a batch of 18 samples for m = 4
    with a ConfigError naming both numbers, on every rank, before any work, so the next batch
    trains exactly as torch's run without the bad batch. (torch 2.13 checks stage shapes only
    under TORCH_DISTRIBUTED_DEBUG=DETAIL; by default it splits such a batch into unequal
    micro-batches that do not fit its receive buffers, so torch runs only the good batches.)"""
    for rank in range(WORLD):
        got = _ok(_result(runs, "syncline", "uneven", rank), "syncline uneven")
        _assert_refused(got["refusal"], "ConfigError", "18 samples", "num_microbatches=4")
    _compare_training(runs, "uneven")


# -- micro-batches and schedule order, checked in this process --------------------------------


@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_split_and_merge(m: int) -> None:
    """Ported from test_microbatch.py::MicrobatchTests.test_split_and_merge: syncline cuts a
    batch (a tensor, or a dict of tensors by argument name, as a traced model takes) into
    exactly torch's micro-batches (``split_args_kwargs_into_chunks``, dimension 0), and
    torch's ``merge_chunks`` puts syncline's micro-batches back into the batch."""
    g = torch.Generator().manual_seed(7)
    x, y, t = (torch.randn(16, 3 + i, generator=g) for i in range(3))
    target = torch.arange(16)
    batch = take_batch(iter([(x, target)]), 0, m)
    args, kwargs = split_args_kwargs_into_chunks((x,), {"x": x, "y": y, "t": t}, m)
    assert len(batch.inputs) == len(args) == m
    for ours, (theirs,) in zip(batch.inputs, args, strict=True):
        assert torch.equal(ours, theirs)
    torch.testing.assert_close(merge_chunks([(p,) for p in batch.inputs], None), (x,))
    assert torch.equal(torch.cat(batch.targets), target)
    named = take_batch(iter([({"x": x, "y": y, "t": t}, target)]), 1, m)
    assert len(named.inputs) == m
    for ours, theirs in zip(named.inputs, kwargs, strict=True):
        assert isinstance(ours, dict) and ours.keys() == theirs.keys()
        for k in theirs:
            assert torch.equal(ours[k], theirs[k]), k


# schedule order, checked on syncline's schedule IR with torch's own checkers

# test_schedule.py::TestSchedulePlan's grid: (stages per rank, micro-batches, ranks), less its
# 32- and 64-rank rows (each takes seconds here); rows with m not a multiple of the ranks are
# skipped, as upstream's test_pipeline_order skips them (syncline refuses them, tested above).
PLAN_GRID = [
    (2, 2, 2), (2, 4, 4), (2, 8, 2), (2, 8, 4), (2, 8, 8), (4, 4, 4), (4, 8, 4), (4, 8, 8),
    (4, 16, 4), (4, 32, 4), (4, 64, 4), (4, 16, 16), (3, 2, 2), (3, 8, 2), (3, 12, 4),
    (4, 6, 3), (4, 10, 5), (2, 3, 4), (2, 10, 4), (2, 15, 4),
]  # fmt: skip
_PEER_KIND = {ActionKind.FORWARD: _ComputationType.FORWARD,
              ActionKind.BACKWARD: _ComputationType.FULL_BACKWARD}  # fmt: skip


def _compute_only(schedule: Schedule) -> dict[int, list[_Action]]:
    """syncline's forwards and backwards of each rank, in order, as torch's actions."""
    return {
        rank: [_Action(a.stage, _PEER_KIND[a.kind], a.microbatch) for a in acts
               if a.kind in _PEER_KIND]
        for rank, acts in schedule.actions.items()
    }  # fmt: skip


@pytest.mark.parametrize("name", ["interleaved", "1f1b", "gpipe"])
def test_pipeline_order(name: str) -> None:
    """Ported from test_schedule.py::TestSchedulePlan.test_pipeline_order (and
    TestValidateSchedule): syncline's schedule for each row of upstream's grid (interleaved:
    that many stages per rank; GPipe, 1F1B: one) must pass torch's own ``_validate_schedule``
    (every stage on one rank, each micro-batch's forward before its backward, m of each) and
    run to the end in torch's ``_simulate_comms_compute`` once torch's ``_add_send_recv`` adds
    the messages; and every forward and backward must appear exactly once."""
    shapes = {
        (local * ranks if name == "interleaved" else ranks, m, ranks)
        for local, m, ranks in PLAN_GRID
        if m % ranks == 0
    }
    for stages, m, ranks in sorted(shapes):
        plan = build_plan(name, ranks, stages, m)
        actions = _compute_only(plan.schedule)
        counts = Counter(a for acts in actions.values() for a in acts)
        assert len(counts) == 2 * stages * m and set(counts.values()) == {1}, (stages, m)
        where = _validate_schedule(actions, ranks, stages, m)  # raises AssertionError if not
        assert where == {s: s % ranks for s in range(stages)}, (stages, m, ranks)

        def home(stage: int, ranks: int = ranks) -> int:
            return stage % ranks

        simulated = _simulate_comms_compute(_add_send_recv(actions, home, stages), home, stages)
        done = Counter(a for acts in simulated.values() for a in acts if a is not None)
        assert all(done[a] == 1 for a in counts), (stages, m, ranks)


def test_invalid_schedule_missing_rank() -> None:
    """Ported from test_schedule.py::TestValidateSchedule.test_invalid_schedule_missing_rank: a
    schedule for 2 ranks that has actions for rank 0 only is refused, naming the ranks."""
    with pytest.raises(ScheduleError, match=r"actions has ranks \[0\], expected 0..1"):
        Schedule.from_strings("missing-rank", 2, 1, {0: "0F0 0B0"})


def test_invalid_schedule_missing_action() -> None:
    """Ported from test_schedule.py::TestValidateSchedule.test_invalid_schedule_missing_action:
    forwards without their backwards are refused, naming the first missing one."""
    schedule = Schedule.from_strings("missing-action", 2, 1, {0: "0F0", 1: "1F0"})
    with pytest.raises(ScheduleError, match="incomplete: stage 0 never runs 0B0"):
        validate(schedule)
