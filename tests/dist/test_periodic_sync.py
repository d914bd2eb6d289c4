"""Synchronising less often (``DataParallel(sync=...)``) on 2 gloo ranks.

- Post-local SGD against torch's own: ``DDP`` with ``post_localSGD_hook``
  (``post_local_gradient_allreduce=False``: each rank steps alone after the start) and
  ``PostLocalSGDOptimizer`` over a ``PeriodicModelAverager``, from the same weights on the
  same batches: the parameters after every step are equal bit for bit. The maths says they
  must be on 2 ranks: the dense steps sum two gradients each multiplied by 1/2 (DDP divides by
  2: the same bits for a power of two), the averaging divides the same flat buffer by 2 and
  sums two values, and a sum of two floats does not depend on the order. (On 3 or more
  ranks gloo's ring adds in an order that depends on where an element lies in its buffer,
  and syncline's gradient buckets are cut elsewhere than DDP's: equality is not promised
  there, and not tested.)
- DiLoCo against a one-process reference written here: two replicas, AdamW inside, the outer
  step with ``torch.optim.SGD(nesterov=True)`` on per-parameter outer weights.
- Both resume bit-exact from a state taken inside a period.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from syncline import DataParallel
from syncline.dp.periodic import DiLoCo, LocalSGD
from syncline.errors import ConfigError
from syncline.testing import run_ranks

STEPS = 11


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(6, 8, generator=gen), torch.randint(0, 4, (6,), generator=gen)


def _optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)


def _train(model: nn.Module, opt, rank: int, steps: range) -> list[list[torch.Tensor]]:
    seen = []
    for step in steps:
        x, y = _batch(rank, step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        seen.append([p.detach().clone() for p in model.parameters()])
    return seen


def _torch_localsgd_rank(rank: int, world: int, optimizer: str, period: int, start: int):
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
        PostLocalSGDState,
        post_localSGD_hook,
    )
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(_net())
    state = PostLocalSGDState(None, None, start, post_local_gradient_allreduce=False)
    ddp.register_comm_hook(state, post_localSGD_hook)
    opt = PostLocalSGDOptimizer(
        _optimizer(optimizer, ddp.parameters()), PeriodicModelAverager(period, start)
    )
    theirs = _train(ddp, opt, rank, range(STEPS))
    dp = DataParallel(_net(), bucket_cap_mb=25, sync=f"localsgd:{period}:start={start}")
    mine_opt = _optimizer(optimizer, dp.parameters())
    dp.attach(mine_opt)
    mine = _train(dp, mine_opt, rank, range(STEPS))
    return theirs, mine, dp.last_stats.step


@pytest.mark.parametrize(("optimizer", "period", "start"), [("sgd", 3, 2), ("adamw", 4, 0)])
def test_localsgd_equals_torchs_post_local_sgd_bit_for_bit(optimizer, period, start) -> None:
    ranks = run_ranks(_torch_localsgd_rank, 2, optimizer, period, start)
    for rank, (theirs, mine, last_synced) in enumerate(ranks):
        for step, (a, b) in enumerate(zip(theirs, mine, strict=True)):
            for i, (p, q) in enumerate(zip(a, b, strict=True)):
                assert torch.equal(p, q), (rank, step, i, (p - q).abs().max())
        assert last_synced == max(0, start - 1)  # no gradient averaged after the start
    # the replicas drift between averagings and agree right after one
    (_, a, _), (_, b, _) = ranks
    averaged = {t for t in range(STEPS) if t >= start and (t - start) % period == 0}
    for step in range(STEPS):
        same = all(torch.equal(p, q) for p, q in zip(a[step], b[step], strict=True))
        assert same == (step < start or step in averaged), step


def _diloco_rank(rank: int, world: int, h: int, start: int):
    dp = DataParallel(_net(), bucket_cap_mb=25, sync=DiLoCo(h, start_step=start))
    opt = _optimizer("adamw", dp.parameters())
    dp.attach(opt)
    return _train(dp, opt, rank, range(STEPS)), dp.sync.in_sync()


def _diloco_reference(world: int, h: int, start: int) -> list[list[list[torch.Tensor]]]:
    """Every replica's parameters after every step, in one process."""
    nets = [_net() for _ in range(world)]
    opts = [_optimizer("adamw", n.parameters()) for n in nets]
    outer: list[torch.Tensor] | None = None
    outer_opt = None
    seen: list[list[list[torch.Tensor]]] = [[] for _ in range(world)]
    for step in range(STEPS):
        if step == start:
            outer = [p.detach().clone() for p in nets[0].parameters()]
            outer_opt = torch.optim.SGD(outer, lr=0.7, momentum=0.9, nesterov=True)
        grads = []
        for r, net in enumerate(nets):
            x, y = _batch(r, step)
            net.zero_grad()
            F.cross_entropy(net(x), y).backward()
            grads.append([p.grad.clone() for p in net.parameters()])
        if step < start:  # data parallel: the mean gradient on every replica
            mean = [sum(g[i] * (1 / world) for g in grads) for i in range(len(grads[0]))]
            for net in nets:
                for p, g in zip(net.parameters(), mean, strict=True):
                    p.grad.copy_(g)
        for opt in opts:
            opt.step()
        if step >= start and (step - start + 1) % h == 0:
            assert outer is not None and outer_opt is not None
            for i, o in enumerate(outer):
                o.grad = sum((o - list(n.parameters())[i].detach()) * (1 / world) for n in nets)
            outer_opt.step()
            with torch.no_grad():
                for net in nets:
                    for p, o in zip(net.parameters(), outer, strict=True):
                        p.copy_(o)
        for r, net in enumerate(nets):
            seen[r].append([p.detach().clone() for p in net.parameters()])
    return seen


@pytest.mark.parametrize(("h", "start"), [(3, 2), (4, 0)])
def test_diloco_equals_a_one_process_reference(h, start) -> None:
    ranks = run_ranks(_diloco_rank, 2, h, start)
    reference = _diloco_reference(2, h, start)
    for rank, (mine, in_sync) in enumerate(ranks):
        assert in_sync == ((STEPS - start) % h == 0)
        for step, (a, b) in enumerate(zip(reference[rank], mine, strict=True)):
            for i, (p, q) in enumerate(zip(a, b, strict=True)):
                assert torch.equal(p, q), (rank, step, i, (p - q).abs().max())
    # the outer step moved the weights (not a copy of one replica's, not their plain mean)
    t = start + h - 1
    r0, r1 = reference[0], reference[1]
    assert all(torch.equal(p, q) for p, q in zip(r0[t], r1[t], strict=True))
    before = [(p + q) / 2 for p, q in zip(r0[t - 1], r1[t - 1], strict=True)]
    assert not all(torch.equal(p, q) for p, q in zip(before, r0[t], strict=True))


def _resume_rank(rank: int, world: int, spec: str, cut: int):
    def build():
        dp = DataParallel(_net(), bucket_cap_mb=25, sync=spec)
        opt = _optimizer("adamw", dp.parameters())
        dp.attach(opt)
        return dp, opt

    dp, opt = build()
    whole = _train(dp, opt, rank, range(STEPS))[-1]
    dp, opt = build()
    _train(dp, opt, rank, range(cut))
    saved = copy.deepcopy(
        {"model": dp.module.state_dict(), "opt": opt.state_dict(), "sync": dp.sync.state_dict()}
    )
    in_sync = dp.sync.in_sync()
    dp, opt = build()
    dp.module.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    dp.sync.load_state_dict(saved["sync"])
    resumed = _train(dp, opt, rank, range(cut, STEPS))[-1]
    return whole, resumed, in_sync


@pytest.mark.parametrize("spec", ["localsgd:3:start=2", "diloco:3:start=2"])
def test_resume_inside_a_period_is_bit_exact(spec) -> None:
    cut = 7  # localsgd averages after steps 2, 5, 8; diloco steps outside after 4, 7, 10
    for whole, resumed, in_sync in run_ranks(_resume_rank, 2, spec, cut):
        assert not in_sync  # the state was taken between two synchronisations
        for p, q in zip(whole, resumed, strict=True):
            assert torch.equal(p, q)


def _refusals_rank(rank: int, world: int) -> list[str]:
    found = []
    dp = DataParallel(_net(), sync="localsgd:2")
    x, y = _batch(rank, 0)
    try:  # no optimizer attached: its averagings would never happen
        F.cross_entropy(dp(x), y).backward()
    except ConfigError as exc:
        found.append(str(exc))
    try:
        DataParallel(_net(), sync="diloco:4", compression=_csc())
    except ConfigError as exc:
        found.append(str(exc))
    try:
        with DataParallel(_net(), sync=LocalSGD(2)).join():
            pass
    except ConfigError as exc:
        found.append(str(exc))
    return found


def _csc():
    from syncline.dp.compressors import CSC

    return CSC(0.1)


def test_a_periodic_sync_refuses_what_would_break_it() -> None:
    no_opt, residuals, join = run_ranks(_refusals_rank, 2)[0]
    assert "model.attach(optimizer)" in no_opt
    assert "sync='diloco' with compression='csc'" in residuals and "fp16" in residuals
    assert "join() with sync='localsgd'" in join


# -- through `syncline train`: checkpointed inside a period, resumed bit for bit ------------
TINY = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--seq-len", "16"]
TINY += ["--batch-size", "8", "--log-every", "1", "--warmup-steps", "2", "--steps", "9"]
TINY += ["--eval-every", "0"]


@pytest.mark.parametrize(
    ("spec", "synced_after"),
    [("localsgd:3:start=2", {2, 5, 8}), ("diloco:3:start=1", {3, 6})],
)
def test_syncline_train_resumes_from_inside_a_period_bit_exact(tmp_path, spec, synced_after):
    """The checkpoint of step 5 is taken with the replicas apart (each rank's weights and
    AdamW moments are its own); rank 1 dies at step 6; ``--resume`` ends with the
    uninterrupted run's weights, optimizer and sync state, bit for bit."""
    import json

    from syncline.train.checkpoint import load_checkpoint
    from tests.zoo.train import train, train_failing

    ref = tmp_path / "ref"
    train(*TINY, "--run-dir", str(ref), "--sync", spec)
    run = tmp_path / "run"
    failed = train_failing(
        *TINY, "--run-dir", str(run), "--sync", spec, "--checkpoint-every", "5",
        "--inject-failure", "1:6",
    )  # fmt: skip
    assert "rank 1: injected failure at step 6" in failed.text, failed.text[-3000:]
    text = train(*TINY, "--run-dir", str(run), "--sync", spec, "--resume", str(run)).text
    assert "(step 5)" in text, text[-3000:]
    a, b = load_checkpoint(ref / "checkpoint.pt"), load_checkpoint(run / "checkpoint.pt")
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert a["optimizer"]["state"]
    for i, state in a["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(value, b["optimizer"]["state"][i][key]), (i, key)
    assert a["sync"]["state"]["step"] == b["sync"]["state"]["step"] == 9
    for key, value in a["sync"]["state"].items():
        same = torch.equal(value, b["sync"]["state"][key]) if torch.is_tensor(value) else (
            value == b["sync"]["state"][key]
        )
        assert same, key
    records = [json.loads(line) for line in (ref / "metrics.jsonl").read_text().splitlines()]
    start = 2 if spec.startswith("localsgd") else 1
    for r in records:  # bytes only where a backward averaged or the replicas synchronised
        assert (r["wire_bytes"] > 0) == (r["step"] < start or r["step"] in synced_after), r
