"""Pipelines on 2 and 4 gloo ranks == one process on the whole batch (2BW: the stale rule).

Each world size is one spawn running every case of the schedule zoo
(``tests.zoo.schedules.PARITY``), so the set stays fast on two cores. The sequence length
changes from step to step (8, 5, 8, ...), so every case also checks that activations of a new
shape flow without any setup.
"""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch

from syncline.testing import run_ranks
from tests.zoo import schedules
from tests.zoo.models import LM_STEPS, lm_batches, lm_reference, tiny_gpt

CASES = schedules.PARITY


def _train_rank(rank: int, world: int) -> dict[str, dict]:
    out = {}
    for name, case in CASES[world].items():
        pipe = case.pipeline(timeout_s=30, track_memory=True)
        batches, losses = iter(lm_batches()), []
        for _ in range(LM_STEPS - 1):
            losses.append(pipe.train_step(batches))
        if case.schedule == "2bw":
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


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def run(request) -> tuple[int, list[dict]]:
    world = request.param
    return world, run_ranks(_train_rank, world, timeout_s=150)


def test_parameters_and_losses_match_single_process(run) -> None:
    world, per_rank = run
    for name, case in CASES[world].items():
        want_state, want_losses = case.reference()
        state = {}
        for r in per_rank:
            state.update(r[name]["state"])
        assert set(state) == set(want_state), name
        for key, value in want_state.items():
            torch.testing.assert_close(state[key], value, atol=1e-5, rtol=0, msg=f"{name} {key}")
        for r in per_rank:  # every rank returns the batch loss
            assert r[name]["losses"] == pytest.approx(want_losses, abs=1e-5), name
        start = tiny_gpt().state_dict()
        assert not torch.allclose(start["1.attn.c_attn.weight"], want_state["1.attn.c_attn.weight"])


def test_two_bw_differs_from_flush_training(run) -> None:
    _, per_rank = run
    flushed, _ = lm_reference(schedules.optimizer("sgd"), stale=False)
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
        m = CASES[4]["gpipe"].microbatches
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
            assert r[name]["events"] > 4 * LM_STEPS, name
