"""Pipelines on 2 and 4 gloo ranks == one process on the whole batch (2BW: the stale rule).

Each world size is one spawn running every case, so the set stays fast on two cores. The
sequence length changes from step to step (8, 5, 8, ...), so every case also checks that
activations of a new shape flow without any setup.
"""

from __future__ import annotations

import copy
from dataclasses import asdict

import pytest
import torch

from syncline.models import build_model, lm_loss
from syncline.pipeline import Pipeline
from syncline.testing import run_ranks

STEPS = 5
# posted in order, as for NCCL (which matches by order, not tag): no receive posted ahead
IN_ORDER = {"1f1b-in-order", "2bw-in-order"}
BATCH = 8
LR, MOMENTUM = 0.1, 0.9

# name -> (schedule, optimizer, recompute, microbatches, balance (None: profiled), stages)
CASES = {
    2: {
        "gpipe": ("gpipe", "sgd", False, 4, [2, 2], 2),
        "1f1b": ("1f1b", "sgd", False, 4, [2, 2], 2),
        "1f1b-recompute": ("1f1b", "sgd", True, 4, [2, 2], 2),
        "2bw-sgd": ("2bw", "sgd", False, 4, [1, 3], 2),
        "2bw-adam": ("2bw", "adam", False, 4, [2, 2], 2),
        "2bw-recompute": ("2bw", "sgd", True, 2, [2, 2], 2),
        "interleaved": ("interleaved", "sgd", False, 4, [1, 1, 1, 1], 4),
        "interleaved-recompute": ("interleaved", "sgd", True, 2, [1, 1, 1, 1], 4),
        "1f1b-profiled": ("1f1b", "sgd", False, 2, None, 2),
        "1f1b-in-order": ("1f1b", "sgd", False, 4, [2, 2], 2),
        "2bw-in-order": ("2bw", "sgd", True, 2, [2, 2], 2),
    },
    4: {
        "gpipe": ("gpipe", "sgd", False, 8, [1, 1, 1, 1], 4),
        "gpipe-recompute": ("gpipe", "sgd", True, 8, [1, 1, 1, 1], 4),
        "1f1b": ("1f1b", "sgd", False, 8, [1, 1, 1, 1], 4),
        "1f1b-recompute": ("1f1b", "sgd", True, 8, [1, 1, 1, 1], 4),
        "2bw-sgd": ("2bw", "sgd", False, 8, [1, 1, 1, 1], 4),
        "2bw-adam": ("2bw", "adam", False, 4, [1, 1, 1, 1], 4),
        "2bw-recompute": ("2bw", "sgd", True, 8, [1, 1, 1, 1], 4),
    },
}


def _gpt() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return build_model("gpt", n_layer=2, n_embd=16, n_head=2, block_size=8)


def _optimizer(kind: str):
    if kind == "adam":
        # Adam divides by sqrt(v): with the default eps=1e-8 a gradient entry that is zero up
        # to fp32 rounding (summed in another order over micro-batches) becomes a full
        # +-lr step. eps=1e-5 keeps that rounding below the 1e-5 tolerance.
        return lambda ps: torch.optim.Adam(ps, lr=0.01, eps=1e-5)
    return lambda ps: torch.optim.SGD(ps, lr=LR, momentum=MOMENTUM)


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for step in range(STEPS):
        x = torch.randint(0, 256, (BATCH, 8 if step % 2 == 0 else 5), generator=g)
        out.append((x, torch.roll(x, -1, dims=1)))
    return out


def _train_rank(rank: int, world: int) -> dict[str, dict]:
    out = {}
    for name, (schedule, opt, recompute, m, balance, stages) in CASES[world].items():
        pipe = Pipeline(
            _gpt(),
            num_stages=stages,
            num_microbatches=m,
            schedule=schedule,
            loss_fn=lm_loss,
            optimizer=_optimizer(opt),
            recompute=recompute,
            balance=balance,
            timeout_s=30,
            track_memory=True,
        )
        if name in IN_ORDER:
            pipe._links.early = False
        batches, losses = iter(_data()), []
        for _ in range(STEPS - 1):
            losses.append(pipe.train_step(batches))
        if schedule == "2bw":
            losses.append(pipe.flush())  # the fifth batch was started by the fourth call
        else:
            losses.append(pipe.train_step(batches))
            assert pipe.flush() is None
        out[name] = {
            "state": pipe.local_state_dict(),
            "losses": losses,
            "balance": pipe.balance,
            "memory": {s: asdict(v) for s, v in pipe.memory_stats().items()},
            "events": len(pipe.trace().events[rank]),
        }
    return out


def _reference(schedule: str, opt_kind: str) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, whole batches. 2BW: W(t+1) = W(t) - lr * grad f(W(t-1)), W(-1) = W(0),
    i.e. the gradient is taken on a copy one step behind and applied to the newest weights."""
    model = _gpt()
    opt = _optimizer(opt_kind)(model.parameters())
    stale = copy.deepcopy(model)
    losses = []
    for x, y in _data():
        where = stale if schedule == "2bw" else model
        where.zero_grad()
        loss = lm_loss(where(x), y)
        loss.backward()
        losses.append(loss.item())
        newest = copy.deepcopy(model.state_dict())
        for p, q in zip(model.parameters(), where.parameters(), strict=True):
            p.grad = q.grad.clone()
        opt.step()
        stale.load_state_dict(newest)
    return model.state_dict(), losses


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def run(request) -> tuple[int, list[dict]]:
    world = request.param
    return world, run_ranks(_train_rank, world, timeout_s=150)


def test_parameters_and_losses_match_single_process(run) -> None:
    world, per_rank = run
    for name, (schedule, opt, *_rest) in CASES[world].items():
        want_state, want_losses = _reference(schedule, opt)
        state = {}
        for r in per_rank:
            state.update(r[name]["state"])
        assert set(state) == set(want_state), name
        for key, value in want_state.items():
            torch.testing.assert_close(state[key], value, atol=1e-5, rtol=0, msg=f"{name} {key}")
        for r in per_rank:  # every rank returns the batch loss
            assert r[name]["losses"] == pytest.approx(want_losses, abs=1e-5), name
        start = _gpt().state_dict()
        assert not torch.allclose(start["1.attn.c_attn.weight"], want_state["1.attn.c_attn.weight"])


def test_two_bw_differs_from_flush_training(run) -> None:
    _, per_rank = run
    flushed, _ = _reference("1f1b", "sgd")
    got = per_rank[0]["2bw-sgd"]["state"]
    assert not torch.allclose(got["0.wte.weight"], flushed["0.wte.weight"], atol=1e-5)


def test_profiled_balance_is_agreed_by_all_ranks(run) -> None:
    world, per_rank = run
    if world != 2:
        pytest.skip("profiled on 2 ranks")
    splits = [r["1f1b-profiled"]["balance"] for r in per_rank]
    assert splits[0] == splits[1] and sum(splits[0]) == 4 and len(splits[0]) == 2


def test_memory_stash_by_schedule(run) -> None:
    """GPipe stashes m micro-batches on stage 0, 1F1B and 2BW at most d - r on stage r,
    recompute only inputs plus one micro-batch; 2BW holds exactly two weight versions."""
    world, per_rank = run
    if world != 4:
        pytest.skip("measured on 4 stages")
    d = 4
    for rank, result in enumerate(per_rank):
        mem = {name: result[name]["memory"][rank] for name in CASES[4]}
        m = CASES[4]["gpipe"][3]
        full = mem["gpipe"]["microbatch_activation_bytes"]
        inp = mem["gpipe"]["input_bytes"]
        assert mem["gpipe"]["peak_microbatches"] == m
        assert mem["gpipe"]["peak_activation_bytes"] == m * full
        for name in ("1f1b", "2bw-sgd"):
            assert mem[name]["peak_microbatches"] == d - rank, name
            assert mem[name]["peak_activation_bytes"] <= (d - rank) * full, name
        assert mem["1f1b"]["peak_activation_bytes"] == (d - rank) * full
        for name, flight in (("gpipe-recompute", m), ("1f1b-recompute", d - rank)):
            recomputed = mem[name]["peak_activation_bytes"]
            assert recomputed <= (flight - 1) * inp + full, name
            if flight > 1:
                assert recomputed < mem[name.split("-")[0]]["peak_activation_bytes"], name
        assert mem["2bw-recompute"]["peak_activation_bytes"] <= (d - rank - 1) * inp + full
        for name in CASES[4]:
            versions = 2 if name.startswith("2bw") else 1
            assert mem[name]["weight_versions"] == versions, name
            assert mem[name]["peak_weight_bytes"] == versions * mem["gpipe"]["peak_weight_bytes"]
    stage0 = per_rank[0]["gpipe"]["memory"][0]
    assert stage0["peak_activation_bytes"] > 0


def test_every_action_is_traced(run) -> None:
    world, per_rank = run
    for r in per_rank:
        for name in CASES[world]:
            assert r[name]["events"] > 4 * STEPS, name
