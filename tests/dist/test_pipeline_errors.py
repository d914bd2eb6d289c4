"""Failures end every rank quickly with rank, step and action named; bad inputs fail at once."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from syncline import comm
from syncline.errors import CommError, ConfigError
from syncline.models import lm_loss
from syncline.pipeline import Pipeline, StageError
from syncline.testing import RankFailure, run_ranks
from tests.zoo.models import tiny_gpt

TIMEOUT_S = 10.0


class Inject(nn.Module):
    """Identity that raises (or stalls) on its ``at``-th forward call, on one rank."""

    def __init__(self, at: int, stall_s: float = 0.0) -> None:
        super().__init__()
        self.at, self.stall_s, self.calls = at, stall_s, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls - 1 == self.at:
            if self.stall_s:
                time.sleep(self.stall_s)
            else:
                raise ValueError("injected")
        return x


def _mlp(inject: Inject) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), inject, nn.Linear(8, 8), nn.Linear(8, 3))


def _data(n: int, size: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(size, 4, generator=g), torch.randint(0, 3, (size,), generator=g))
        for _ in range(n)
    ]


def _pipe(world: int, inject: Inject, schedule: str = "1f1b", **kw) -> Pipeline:
    return Pipeline(
        _mlp(inject),
        num_stages=world,
        num_microbatches=kw.pop("m", 4),
        schedule=schedule,
        loss_fn=nn.functional.cross_entropy,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
        balance=kw.pop("balance", [2, 2, 1] if world == 3 else [2, 3]),
        timeout_s=kw.pop("timeout_s", TIMEOUT_S),
        **kw,
    )


def _exception_rank(rank: int, world: int) -> dict:
    """Stage 1 raises in the forward of micro-batch 2 of step 1; each rank reports."""
    inject = Inject(at=4 + 2 if rank == 1 else -1)
    pipe = _pipe(world, inject)
    batches = iter(_data(3))
    pipe.train_step(batches)
    start = time.monotonic()
    try:
        pipe.train_step(batches)
    except (StageError, CommError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    else:
        error = "no error"
    elapsed = time.monotonic() - start
    if rank == 1:
        comm.destroy()  # what a crashing process does: its peers see the connection close
    return {"error": error, "elapsed": elapsed}


def test_exception_on_one_stage_ends_every_rank_with_its_step_and_action() -> None:
    results = run_ranks(_exception_rank, 3, timeout_s=60)
    failed = results[1]["error"]
    assert failed.startswith("StageError: rank 1 (stage 1): FORWARD mb 2 of step 1 (1F2@b1)")
    assert "ValueError: injected" in failed
    for rank in (0, 2):
        error = results[rank]["error"]
        assert error.startswith(f"CommError: rank {rank}: "), error
        assert "of step 1 from rank 1" in error, error
        assert results[rank]["elapsed"] < TIMEOUT_S, results[rank]
    assert "RECV_B" in results[0]["error"] and "RECV_F" in results[2]["error"]


def _raising_rank(rank: int, world: int) -> None:
    pipe = _pipe(world, Inject(at=2 * 2 + 1 if rank == 1 else -1), "2bw", m=2, timeout_s=5)
    batches = iter(_data(4))
    for _ in range(3):
        pipe.train_step(batches)


def test_an_uncaught_stage_failure_is_a_rank_failure_naming_it() -> None:
    # 2BW, m=2: the last stage runs each batch whole, so its 6th forward is micro-batch 1 of
    # batch 2, which runs on weight version 1 (one step stale)
    match = r"rank 1 \(stage 1\): FORWARD mb 1 of step 2 \(1F1@v1b2\) failed: ValueError"
    with pytest.raises(RankFailure, match=match):
        run_ranks(_raising_rank, 2, timeout_s=60)


def _inputs_rank(rank: int, world: int) -> dict:
    out: dict = {}
    # 1. a batch that does not split: every rank fails at once, 2BW's batch in flight survives
    pipe = _pipe(world, Inject(-1), "2bw", m=2)
    good = _data(2)
    batches = iter([*good, _data(1, size=5)[0]])
    out["first"] = pipe.train_step(batches)  # takes batch 1 early
    try:
        pipe.train_step(batches)
    except ConfigError as exc:
        out["bad"] = str(exc)
    out["flushed"] = pipe.flush()  # finishes batch 1
    # 2. weights tied across stages: refused before any work
    try:
        gpt = tiny_gpt(tie_weights=True)
        Pipeline(
            gpt,
            num_stages=2,
            num_microbatches=2,
            schedule="1f1b",
            loss_fn=lm_loss,
            optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
            balance=[2, 2],
        )
    except ConfigError as exc:
        out["tied"] = str(exc)
    # 3. a stalled stage: its peer times out naming rank, step and action
    pipe = _pipe(world, Inject(at=0 if rank == 1 else -1, stall_s=4.0), timeout_s=2.0)
    start = time.monotonic()
    try:
        pipe.train_step(iter(_data(1)))
    except (CommError, StageError) as exc:
        out["stall"] = f"{type(exc).__name__}: {exc}"
    out["stall_s"] = time.monotonic() - start
    return out


def test_bad_inputs_fail_on_every_rank_and_a_stall_times_out() -> None:
    results = run_ranks(_inputs_rank, 2, timeout_s=60)
    for rank, out in enumerate(results):
        assert "batch 2 has 5 samples" in out["bad"] and "num_microbatches=2" in out["bad"]
        assert out["flushed"] == results[0]["flushed"] and out["flushed"] > 0
        assert "weights shared across stages" in out["tied"] and "lm_head.weight" in out["tied"]
        assert out["stall"].startswith(f"CommTimeout: rank {rank}: ") or rank == 1, out
    stalled = results[0]
    assert (
        "RECV_B mb 0 of step 0 from rank 1 (0RECV_B0@b0) did not complete within 2s"
        in (stalled["stall"])
    )
    assert stalled["stall_s"] < 3.5


class ShrinkAfter(nn.Module):
    """Identity for ``calls`` forwards, then drops a row: an output shape that does not
    follow from the input's shape (as a data-dependent one would not)."""

    def __init__(self, calls: int) -> None:
        super().__init__()
        self.calls, self.seen = calls, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += 1
        return x if self.seen <= self.calls else x[:-1]


def _shape_change_rank(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    # m=2, micro-batches of 2 rows: steps 0 and 1 send (2, 8); step 2 would send (1, 8)
    model = nn.Sequential(nn.Linear(4, 8), ShrinkAfter(calls=4), nn.Linear(8, 3))
    pipe = Pipeline(
        model,
        num_stages=2,
        num_microbatches=2,
        schedule="1f1b",
        loss_fn=nn.functional.cross_entropy,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
        balance=[2, 1],
        timeout_s=3.0,
    )
    batches = iter(_data(3))
    out: dict = {"losses": [pipe.train_step(batches) for _ in range(2)]}
    try:
        pipe.train_step(batches)
    except (StageError, CommError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def test_an_output_shape_that_changes_for_the_same_input_shape_fails_clearly() -> None:
    results = run_ranks(_shape_change_rank, 2, timeout_s=60)
    sender = results[0]["error"]
    assert sender.startswith("StageError: rank 0 (stage 0): SEND_F mb 0 of step 2"), sender
    assert "stage 0 output [1, 8] float32 for micro-batch inputs [2, 4] float32" in sender
    assert "must follow from the shape of the micro-batch inputs" in sender
    receiver = results[1]["error"]  # waited for the message that never came: named, no hang
    # CommError when gloo reports the closed peer first, its subclass CommTimeout when the
    # 3 s limit comes first (seen on a loaded machine): either way named, and no hang
    assert receiver.startswith(("CommError: rank 1: ", "CommTimeout: rank 1: ")), receiver
    assert "of step 2" in receiver, receiver
    assert all(r["losses"] == results[0]["losses"] for r in results)
