"""The non-finite guard on 2 gloo ranks: ``DataParallel`` with a ``StepGuard`` in a plain loop,
and ``syncline train`` (in-process; slow).

In the loop, rank 1's gradient (or its loss) goes bad at one step: both ranks agree on the
event, rank 1 alone says it saw it, and the weights equal those of a twin model on the same
ranks whose optimizer skipped that step, bit for bit.

In ``syncline train``, a NaN is put into rank 1's gradient of its first parameter at step ``K`` (the testing aid
``--inject-nonfinite 1:K``, keyed to the batch), or its loss multiplied by 1000
(``1:K:spike``), and each action is compared with a reference run, bit for bit:

- ``stop``: the run ends with one line naming the step, rank 1 and the parameter; no
  checkpoint holds step K (none is written after it), and no final checkpoint.
- ``skip``: the final weights and optimizer state equal those of a run whose optimizer was
  simply not called at step K (the reference rank patches the trainer's ``step_unless``
  to return without touching anything at step K); every other step the same.
- ``rollback``: the final weights equal those of a run whose data stream lacks the skipped
  batches (the reference rank patches the trainer's ``batch_of`` to leave them out from
  the start), restored from the checkpoint before K and replayed.

Both runs use the guard's optimizer (fused AdamW), so they share every kernel.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from torch import nn
from torch.nn import functional as F

from syncline import DataParallel
from syncline.errors import ConfigError
from syncline.dp.guard import VERDICT_FIELDS, StepGuard
from syncline.dp.guard_config import GuardConfig
from syncline.optim.skip import step_unless
from syncline.testing import run_ranks
from syncline.testing.training import _training_rank
from syncline.train.checkpoint import load_checkpoint
from syncline.train.preflight import prepare_run_dir
from syncline.train.runs import comparison_table, load_run
from tests.zoo.train import config, train

TINY = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--seq-len", "16"]
TINY += ["--batch-size", "8", "--log-every", "1", "--warmup-steps", "2", "--eval-every", "0"]
TINY += ["--nproc-per-node", "2", "--steps", "8", "--checkpoint-every", "2"]
K = 5  # the step (and batch) of the event
SKIP = 2  # --skip-batches for rollback


def _loop_rank(rank: int, world: int, kind: str, bad_step: int) -> list[dict[str, float]]:
    """A plain loop with the guard; the twin (no guard) skips ``bad_step`` by itself."""
    del world
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.Linear(64, 4))
    twin = copy.deepcopy(net)
    config = GuardConfig(on_nonfinite="skip", spike_factor=20.0, spike_window=3)
    guard = StepGuard(config)
    dp = DataParallel(net, guard=guard, bucket_cap_mb=0.01, first_bucket_cap_mb=0.01)
    ref = DataParallel(twin, bucket_cap_mb=0.01, first_bucket_cap_mb=0.01)
    opt = torch.optim.AdamW(dp.parameters(), lr=0.01, fused=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, fused=True)
    assert len(dp.bucket_plan.buckets) > 1  # the tail rides the last of several
    verdicts = []
    for step in range(6):
        gen = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)
        loss = F.mse_loss(dp(x), y)
        hooks = []
        if rank == 1 and step == bad_step:
            if kind == "spike":
                loss = loss * 1000.0
            else:
                first = next(iter(net.parameters()))
                hooks.append(first.register_hook(lambda g: g * float("nan")))
        guard.watch_loss(loss)
        loss.backward()
        for hook in hooks:
            hook.remove()
        step_unless(opt, guard.skip_flag)
        opt.zero_grad()
        verdicts.append(dict(zip(VERDICT_FIELDS, guard.verdict.tolist(), strict=True)))
        F.mse_loss(ref(x), y).backward()
        if step != bad_step:
            ref_opt.step()
        ref_opt.zero_grad()
    for a, b in zip(net.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)
    return verdicts


def _refusal_rank(rank: int, world: int) -> str:
    """A guard beside a periodic sync: refused before any communication, on every rank."""
    del rank, world
    try:
        DataParallel(nn.Linear(4, 4), guard=StepGuard(GuardConfig("skip")), sync="localsgd:4")
    except ConfigError as exc:
        return str(exc)
    return "accepted"


def test_a_guard_beside_a_periodic_sync_is_refused() -> None:
    for message in run_ranks(_refusal_rank, 2, timeout_s=60):
        assert "guard= with a periodic sync" in message and "sync='every-step'" in message


@pytest.mark.parametrize("kind", ["nan", "spike"])
def test_the_ranks_agree_inside_the_allreduce_and_skip_the_step(kind: str) -> None:
    bad = 4
    per_rank = run_ranks(_loop_rank, 2, kind, bad, timeout_s=120)
    for rank, verdicts in enumerate(per_rank):
        events = [step for step, v in enumerate(verdicts) if v["event"]]
        assert events == [bad], (rank, verdicts)
        seen = verdicts[bad]
        if kind == "nan":
            assert (seen["nonfinite"], seen["local"]) == (1, float(rank == 1))
            assert seen["first_bad"] == (0 if rank == 1 else 6)  # 6 parameters: none
        else:
            assert (seen["spike"], seen["nonfinite"]) == (1, 0)
            assert seen["loss"] > 20 * seen["median"]
    agreed = ("event", "nonfinite", "spike", "loss", "median", "skip")
    for mine, theirs in zip(*per_rank, strict=True):  # the same verdict on both ranks
        assert repr([mine[k] for k in agreed]) == repr([theirs[k] for k in agreed])


def _args(run: Path, action: str, *extra: str) -> list[str]:
    return [*TINY, "--run-dir", str(run), "--on-nonfinite", action, *extra]


def _skip_step_rank(rank: int, world: int, values: dict[str, Any], step: int) -> Any:
    """A reference rank whose optimizer is not called at ``step`` (nothing else changes)."""
    from syncline.train import trainer

    original, calls = trainer.step_unless, [0]

    def patched(opt: torch.optim.Optimizer, flag: torch.Tensor) -> None:
        calls[0] += 1
        if calls[0] - 1 != step:
            original(opt, flag)

    trainer.step_unless = patched
    return _training_rank(rank, world, values, 0)


def _lacking_rank(rank: int, world: int, values: dict[str, Any], lacking: list[int]) -> Any:
    """A reference rank whose data stream lacks the batches ``lacking`` from the start."""
    from syncline.train import guarding, trainer

    trainer.batch_of = lambda step, skipped: guarding.batch_of(step, sorted(lacking))
    return _training_rank(rank, world, values, 0)


def _reference(run: Path, rank_fn: Any, arg: Any, *args: str) -> dict[str, Any]:
    cfg = config(*args)
    prepare_run_dir(cfg)
    run_ranks(rank_fn, 2, cfg.to_dict(), arg, timeout_s=240.0, comm_timeout_s=cfg.timeout_s)
    return load_checkpoint(run / "checkpoint.pt")


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["model"].keys() == b["model"].keys()
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name


def _events(run: Path) -> list[dict[str, Any]]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x)["guard_event"] for x in lines if "guard_event" in x]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["nan", "spike"])
def test_stop_ends_at_the_step_and_writes_no_later_checkpoint(tmp_path: Path, kind: str) -> None:
    run = tmp_path / "run"
    extra = ["--spike-factor", "5", "--spike-window", "3"] if kind == "spike" else []
    done = train(*_args(run, "stop", "--inject-nonfinite", f"1:{K}:{kind}", *extra))
    lines = [x for x in done.stdout.splitlines() if x.startswith("stopped at step")]
    assert len(lines) == 1, done.stdout[-2000:]
    line = lines[0]
    print(line)
    assert line.startswith(f"stopped at step {K}:"), line
    if kind == "nan":
        assert "rank(s) 1, first in parameter '0.wte.weight'" in line, line
    else:
        assert "loss spike" in line, line
    saved = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert saved and all(int(name.split("-")[1]) <= K for name in saved), saved
    assert not (run / "checkpoint.pt").exists()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stopped"] == line
    assert [e["step"] for e in summary["guard_events"]] == [K]
    table = comparison_table([load_run(run)])
    assert f"stop@{K}" in table, table


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["nan", "spike"])
def test_skip_equals_a_run_that_never_took_the_step(tmp_path: Path, kind: str) -> None:
    extra = ["--spike-factor", "5", "--spike-window", "3"] if kind == "spike" else []
    run, ref = tmp_path / "run", tmp_path / "ref"
    train(*_args(run, "skip", "--inject-nonfinite", f"1:{K}:{kind}", *extra))
    expected = _reference(ref, _skip_step_rank, K, *_args(ref, "skip", *extra))
    got = load_checkpoint(run / "checkpoint.pt")
    _same(got, expected)
    for a, b in zip(
        got["optimizer"]["state"].values(), expected["optimizer"]["state"].values(), strict=True
    ):
        for key in a:
            assert torch.equal(a[key], b[key]), key
    events = _events(run)
    assert [(e["step"], e["kind"], e["action"]) for e in events] == [
        (K, "nonfinite" if kind == "nan" else "spike", "skip")
    ]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["skipped_steps"] == 1
    assert "1 skip" in comparison_table([load_run(run)])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["nan", "spike"])
def test_rollback_equals_a_run_whose_stream_lacks_the_skipped_batches(
    tmp_path: Path, kind: str
) -> None:
    extra = ["--spike-factor", "5", "--spike-window", "3"] if kind == "spike" else []
    extra += ["--skip-batches", str(SKIP)]
    run, ref = tmp_path / "run", tmp_path / "ref"
    done = train(*_args(run, "rollback", "--inject-nonfinite", f"1:{K}:{kind}", *extra))
    lacking = list(range(K, K + SKIP))
    expected = _reference(ref, _lacking_rank, lacking, *_args(ref, "rollback", *extra))
    _same(load_checkpoint(run / "checkpoint.pt"), expected)
    (event,) = _events(run)
    assert event["step"] == K and event["action"] == "rollback"
    assert event["rolled_back_to"] == 4 and event["skipped_batches"] == lacking
    assert f"guard: {event['kind']} at step {K} -> rollback" in done.stdout


@pytest.mark.slow
def test_a_rollback_before_the_first_checkpoint_stops_naming_why(tmp_path: Path) -> None:
    run = tmp_path / "run"
    done = train(*_args(run, "rollback", "--inject-nonfinite", "0:1", "--checkpoint-every", "6"))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stopped"].startswith("rollback at step 1: no checkpoint to roll back to")
    assert summary["stopped"] in done.stdout
    assert [e["step"] for e in summary["guard_events"]] == [1]
    assert not (run / "checkpoints").exists() or not list((run / "checkpoints").iterdir())
