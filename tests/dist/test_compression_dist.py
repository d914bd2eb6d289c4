"""Compressors on 2 and 4 gloo ranks: agreement across ranks, accuracy, bytes, and training.

Every rank's local gradients are a pure function of (rank, step, bucket), so the parent
process can recompute what each compressor should have produced.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from syncline import DataParallel
from syncline.comm import FlatAllreduce
from syncline.dp.compression import BucketRef
from syncline.dp.compressors import CSC, build_compressor
from syncline.dp.compressors import chunks as ch
from syncline.dp.compressors.powersgd import matrix_shape, plan_matrices
from syncline.dp.compressors.topk import topk_count
from syncline.testing import run_ranks

SIZES = (300, 77)  # two buckets; the second has a short last chunk
STEPS = 3
CHUNK = 8
SPECS = (
    "fp16",
    "bf16",
    f"csc:0.2:chunk={CHUNK}",
    f"csc:0.2:chunk={CHUNK}:warmup=2",
    "topk:0.05",
    "powersgd:2",
    "powersgd:1",  # with the parameter layouts below: per tensor
)
#: per bucket: ``(offset, shape)`` of its parameters, given to "powersgd:1" only
LAYOUTS = (((0, (20, 15)),), ((0, (7,)), (7, (7, 10))))


def local_grad(rank: int, step: int, bucket: int) -> torch.Tensor:
    """Different on every rank; rank r also has one heavy chunk of its own (chunk 3r), so
    that each rank's local top chunks differ from the globally agreed ones."""
    gen = torch.Generator().manual_seed(1000 * rank + 10 * step + bucket)
    g = torch.randn(SIZES[bucket], generator=gen)
    g[3 * rank * CHUNK : (3 * rank + 1) * CHUNK] += 4.0
    return g


def _reduce_rank(rank: int, world: int) -> dict:
    comm = FlatAllreduce(timeout_s=60.0)
    out: dict = {}
    for spec in SPECS:
        comp = build_compressor(spec)
        steps = []
        for step in range(1, STEPS + 1):
            grads = [local_grad(rank, step, b) for b in range(len(SIZES))]
            layouts = LAYOUTS if spec == "powersgd:1" else ((), ())
            pendings = [
                comp.reduce(BucketRef(b, step, layouts[b]), g, comm) for b, g in enumerate(grads)
            ]
            for p in pendings:
                p.wait()
            steps.append(
                {
                    "out": grads,
                    "wire": [p.wire_bytes for p in pendings],
                    "selection": [
                        t.clone() for _, t in sorted(getattr(comp, "last_selection", {}).items())
                    ],
                    "state": comp.state_dict(),
                }
            )
        out[spec] = steps
    return out


def _mean(world: int, step: int, bucket: int) -> torch.Tensor:
    return torch.stack([local_grad(r, step, bucket) for r in range(world)]).mean(0)


@pytest.fixture(scope="module", params=[2, 4])
def reduced(request: pytest.FixtureRequest) -> tuple[int, list[dict]]:
    world = request.param
    return world, run_ranks(_reduce_rank, world, timeout_s=120.0)


def test_every_compressor_gives_identical_results_on_all_ranks(reduced) -> None:
    world, results = reduced
    for spec in SPECS:
        for step in range(STEPS):
            for r in range(1, world):
                for a, b in zip(
                    results[0][spec][step]["out"], results[r][spec][step]["out"], strict=True
                ):
                    assert torch.equal(a, b), (spec, step, r)


@pytest.mark.parametrize(("spec", "eps"), [("fp16", 2.0**-11), ("bf16", 2.0**-8)])
def test_half_width_equals_the_fp32_average_to_its_precision(reduced, spec, eps) -> None:
    world, results = reduced
    for step in range(STEPS):
        for b, n in enumerate(SIZES):
            mean = _mean(world, step + 1, b)
            got = results[0][spec][step]["out"][b]
            # each of the p-1 in-collective additions rounds once, plus the final cast
            bound = (
                world
                * eps
                * torch.stack([local_grad(r, step + 1, b).abs() / world for r in range(world)]).sum(
                    0
                )
            )
            assert torch.all((got - mean).abs() <= bound + 1e-7), (spec, step, b)
            assert results[0][spec][step]["wire"][b] == 2 * n


def test_csc_agrees_on_the_same_chunks_though_local_gradients_differ(reduced) -> None:
    world, results = reduced
    spec = SPECS[2]
    for b, n in enumerate(SIZES):
        n_chunks = ch.num_chunks(n, CHUNK)
        k = int(0.2 * n_chunks)  # the first step's budget: its share, rounded down
        # step 1 from a zero state: u = g, v = u, so the scores are those of g
        grads = [local_grad(r, 1, b) for r in range(world)]
        scores = [ch.chunk_scores(g, CHUNK, normalise=True) for g in grads]
        expected = ch.select_chunks(torch.stack(scores).sum(0), k)
        local_picks = {tuple(ch.select_chunks(s, k).tolist()) for s in scores}
        assert len(local_picks) > 1  # ranks would disagree if each chose for itself
        for r in range(world):
            assert torch.equal(results[r][spec][0]["selection"][b], expected)
        mask = ch.element_mask(expected, n_chunks, CHUNK, n)
        got = results[0][spec][0]["out"][b]
        torch.testing.assert_close(got[mask], _mean(world, 1, b)[mask], atol=2e-3, rtol=2e-3)
        assert not got[~mask].any()
        sent = k * CHUNK  # whatever the values: a selected short last chunk travels padded
        assert results[0][spec][0]["wire"][b] == 4 * (n_chunks + 1) + 2 * sent  # scores, bound
    # the selection moves over steps (error feedback brings the unsent chunks back)
    firsts = [results[0][spec][s]["selection"][0].tolist() for s in range(STEPS)]
    assert firsts[0] != firsts[1]


def test_csc_warmup_is_dense_then_sparse(reduced) -> None:
    world, results = reduced
    steps = results[0][SPECS[3]]
    for b, n in enumerate(SIZES):
        assert steps[0]["wire"][b] == 4 + 2 * n  # step 1 < warmup=2: a bound, all of v in fp16
        assert steps[1]["wire"][b] < 2 * n
        torch.testing.assert_close(steps[0]["out"][b], _mean(world, 1, b), atol=5e-3, rtol=2e-3)


def test_topk_sums_every_ranks_own_top_k(reduced) -> None:
    world, results = reduced
    for b, n in enumerate(SIZES):
        k = topk_count(0.05, n)
        expected = torch.zeros(n)
        for r in range(world):
            g = local_grad(r, 1, b)
            idx = torch.topk(g.abs(), k).indices
            expected[idx] += g[idx]
        torch.testing.assert_close(results[0]["topk:0.05"][0]["out"][b], expected / world)
        assert results[0]["topk:0.05"][0]["wire"][b] == k * (4 + 4)


@pytest.mark.parametrize("spec", ["powersgd:2", "powersgd:1"])
def test_powersgd_mean_of_local_approximations_plus_residuals(reduced, spec: str) -> None:
    world, results = reduced
    # bare buckets: one near-square matrix each; with layouts: 20x15 | 7 dense + 7x10
    wires = {
        "powersgd:2": [4 * 2 * sum(matrix_shape(n)) for n in SIZES],
        "powersgd:1": [4 * (20 + 15), 4 * (7 + 7 + 10)],  # dense 7, P 20 | 7, Q 15 | 10
    }[spec]
    for step in range(STEPS):
        for b, n in enumerate(SIZES):
            before = [
                results[r][spec][step - 1]["state"]["buckets"][b]["residual"]
                if step
                else torch.zeros(n)
                for r in range(world)
            ]
            after = [
                results[r][spec][step]["state"]["buckets"][b]["residual"] for r in range(world)
            ]
            m = torch.stack([before[r] + local_grad(r, step + 1, b) for r in range(world)]).mean(0)
            got = results[0][spec][step]["out"][b] + torch.stack(after).mean(0)
            torch.testing.assert_close(got, m, atol=1e-4, rtol=1e-4)
            assert results[0][spec][step]["wire"][b] == wires[b]


# -- training --------------------------------------------------------------------------
TRAIN_SPECS = ("none", "fp16", "bf16", "csc:0.25:chunk=16", "topk:0.1", "powersgd:2")
TRAIN_STEPS = 40


def _mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)
    )


def _train_rank(rank: int, world: int) -> dict:
    teacher = _mlp()
    teacher.load_state_dict({k: v * 2 for k, v in _seeded_mlp(7).state_dict().items()})
    out = {}
    for spec in TRAIN_SPECS:
        model = _seeded_mlp(0)
        dp = DataParallel(model, bucket_cap_mb=0.0005, compression=build_compressor(spec))
        opt = torch.optim.SGD(dp.parameters(), lr=0.1, momentum=0.0)
        losses, wire = [], []
        for step in range(TRAIN_STEPS):
            gen = torch.Generator().manual_seed(100 * step + rank)
            x = torch.randn(32, 16, generator=gen)
            with torch.no_grad():
                y = teacher(x)
            opt.zero_grad()
            loss = F.mse_loss(dp(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            wire.append(dp.last_stats.wire_bytes)
        params = torch.cat([p.detach().flatten() for p in model.parameters()])
        plan = dp.bucket_plan
        shapes = [tuple(p.shape) for p in model.parameters()]
        layouts = [
            tuple((plan.offsets[i] - b.start, shapes[i]) for i in b.params) for b in plan.buckets
        ]
        out[spec] = {
            "layouts": layouts,
            "bucket_numels": [b.numel for b in plan.buckets],
            "losses": losses,
            "wire": wire,
            "dense": dp.last_stats.dense_bytes,
            "buckets": len(dp.bucket_plan.buckets),
            "params": params,
        }
    return out


def _seeded_mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return _mlp()


def test_data_parallel_training_with_every_compressor_decreases_loss() -> None:
    results = run_ranks(_train_rank, 2, timeout_s=120.0)
    for spec in TRAIN_SPECS:
        r0, r1 = results[0][spec], results[1][spec]
        assert torch.equal(r0["params"], r1["params"]), spec  # replicas stay identical
        assert r0["buckets"] > 1, spec  # several buckets: the two-phase order is exercised
        first = sum(r0["losses"][:3]) / 3
        last = sum(r0["losses"][-5:]) / 5
        assert last < 0.6 * first, (spec, first, last)
        dense = r0["dense"]
        assert r0["wire"][0] == dense  # step 0 is always lossless fp32
        if spec != "none":
            assert max(r0["wire"][1:]) <= dense // 2 + 1, spec
        if spec in ("fp16", "bf16"):
            assert r0["wire"][1:] == [dense // 2] * (TRAIN_STEPS - 1)
    # PowerSGD got each bucket's parameter layout from the engine: per-tensor byte count
    r0 = results[0]["powersgd:2"]
    plans = [
        plan_matrices(n, lay, 2) for n, lay in zip(r0["bucket_numels"], r0["layouts"], strict=True)
    ]
    assert any(pl.matrices for pl in plans) and any(pl.dense for pl in plans)
    expected = sum(4 * (pl.dense_numel + pl.p_numel + pl.q_numel) for pl in plans)
    assert r0["wire"][-1] == expected


# -- CSC at the edges ------------------------------------------------------------------
def _overflow_rank(rank: int, world: int) -> dict:
    """Each rank alone fits fp16 after dividing by the world size; the sum does not."""
    comm = FlatAllreduce(timeout_s=60.0)
    out = {}
    for density in (0.5, 1.0):
        g = local_grad(rank, 1, 1)
        g[9] = 1e5  # 1e5 / 2 fits fp16 (max 65504) on each rank, their sum 1e5 does not
        csc = build_compressor(f"csc:{density}:chunk={CHUNK}")
        pending = csc.reduce(BucketRef(0, 1), g, comm)
        pending.wait()
        out[density] = {"out": g, "wire": pending.wire_bytes, "sel": csc.last_selection[0]}
    return out


def test_csc_scales_a_bucket_into_fp16_when_the_sum_would_overflow_it() -> None:
    results = run_ranks(_overflow_rank, 2, timeout_s=60.0)
    n = SIZES[1]
    local = [local_grad(r, 1, 1) for r in range(2)]
    for g in local:
        g[9] = 1e5
    # the summed bound 1e5 is past 65504: both ranks send v / (2 * 4) in fp16, scaled back x4
    scaled = (local[0] / 8).half() + (local[1] / 8).half()
    for density, r0 in results[0].items():
        mask = ch.element_mask(r0["sel"], ch.num_chunks(n, CHUNK), CHUNK, n)
        assert bool(mask[9]) and torch.isfinite(r0["out"]).all()
        assert torch.equal(r0["out"][mask], scaled.float()[mask] * 4)
        assert torch.equal(r0["out"], results[1][density]["out"])
        sent = int(r0["sel"].numel()) * CHUNK if density < 1 else n
        head = 4 * (ch.num_chunks(n, CHUNK) + 1) if density < 1 else 4
        assert r0["wire"] == head + 2 * sent  # fp16 on both ranks, fixed by the shapes


class _Sometimes(nn.Module):
    """``b`` takes part only at step 1 (``use_b``); ``a`` always."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.use_b = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + (self.b(x) if self.use_b else 0.0)


def _unused_rank(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = _Sometimes()
    start = {k: v.clone() for k, v in model.b.state_dict().items()}
    dp = DataParallel(
        model, find_unused_parameters=True, bucket_cap_mb=0.00005, first_bucket_cap_mb=0.00005,
        compression=build_compressor("csc:0.25:chunk=4:momentum=0"),
    )  # fmt: skip
    opt = torch.optim.SGD(dp.parameters(), lr=0.5)
    local: dict[str, torch.Tensor] = {}
    hooks = [
        p.register_hook(lambda g, n=n: local.setdefault(n, g.clone()))
        for n, p in model.b.named_parameters()
    ]
    for step in range(9):
        model.use_b = step == 1
        gen = torch.Generator().manual_seed(10 * step + rank)
        x, y = torch.randn(8, 4, generator=gen), torch.randn(8, 4, generator=gen)
        opt.zero_grad()
        F.mse_loss(dp(x), y).backward()
        opt.step()
    for h in hooks:
        h.remove()
    return {"start": start, "end": model.b.state_dict(), "local": local}


def test_csc_keeps_and_later_applies_the_residual_of_a_parameter_no_rank_uses() -> None:
    """``b`` is used at step 1 only; CSC (one chunk in four a step) sends part of its
    gradient then and the rest at later steps, when no rank uses ``b``. That rest must
    reach ``b`` (error feedback delays a gradient, never drops it): at the end ``b`` has
    moved by exactly lr x the ranks' mean step-1 gradient."""
    results = run_ranks(_unused_rank, 2, timeout_s=60.0)
    for name in ("weight", "bias"):
        mean = torch.stack([r["local"][name] for r in results]).mean(0)
        want = results[0]["start"][name] - 0.5 * mean
        for r in results:
            # fp16 on the wire: what rounding lost waits in the residual (~1e-4 here); a
            # dropped chunk would be off by the gradient itself (~0.1)
            torch.testing.assert_close(r["end"][name], want, atol=1e-3, rtol=2e-3)
            assert not torch.equal(r["end"][name], r["start"][name])


LANE_SPECS = (f"csc:0.2:chunk={CHUNK}", "powersgd:2")


def _lane_rank(rank: int, world: int) -> dict:
    """Each two-phase compressor run twice on the same gradients: on one group (phase two
    issued when every rank reaches the same point) and with a lane (phase two issued by
    ``poll`` as soon as this rank sees phase one done, at a rank-dependent moment)."""
    import time

    from syncline.comm import with_lane

    plain = FlatAllreduce(timeout_s=60.0)
    laned = with_lane(FlatAllreduce(timeout_s=60.0))
    out: dict = {"has_lane": laned.lane is not None}
    for spec in LANE_SPECS:
        for name, comm in (("plain", plain), ("laned", laned)):
            comp = build_compressor(spec)
            results, early_before_next = [], []
            for step in range(1, STEPS + 1):
                grads = [local_grad(rank, step, b) for b in range(len(SIZES))]
                pendings = []
                for b, g in enumerate(grads):
                    before = comp._order.issued_by_poll
                    pendings.append(comp.reduce(BucketRef(b, step, ((), ())[b]), g, comm))
                    time.sleep(0.01 * (rank + 1))  # ranks reach their polls at other times
                    deadline = time.monotonic() + 10.0
                    while name == "laned" and comp._order.issued_by_poll == before:
                        comp.poll()  # what the engine's gradient hooks do
                        assert time.monotonic() < deadline, "phase two never issued by poll"
                    early_before_next.append(comp._order.issued_by_poll)
                for p in pendings:
                    p.wait()
                results.append([g.clone() for g in grads])
            out[(spec, name)] = {"out": results, "early": early_before_next}
    return out


def test_a_second_lane_issues_phase_two_early_with_the_same_results_bit_for_bit() -> None:
    """CSC's payload and PowerSGD's Q go on the lane the moment their phase one is done,
    polled at different moments on each rank, and every result equals the one-group run's."""
    results = run_ranks(_lane_rank, 2, timeout_s=120.0)
    for res in results:
        assert res["has_lane"]
        for spec in LANE_SPECS:
            plain, laned = res[(spec, "plain")], res[(spec, "laned")]
            # every bucket's phase two was issued by a poll, before the next bucket started
            assert laned["early"] == list(range(1, STEPS * len(SIZES) + 1))
            for a, b in zip(plain["out"], laned["out"], strict=True):
                for x, y in zip(a, b, strict=True):
                    assert torch.equal(x, y), spec
    for spec in LANE_SPECS:  # and the ranks agree
        for x, y in zip(results[0][(spec, "laned")]["out"], results[1][(spec, "laned")]["out"]):
            assert all(torch.equal(a, b) for a, b in zip(x, y, strict=True))


def _two_engines_rank(rank: int, world: int) -> dict:
    """Two DataParallel modules in one autograd graph, each with a two-phase compressor and
    (on gloo) a lane of its own, against the same run with no lanes."""
    out: dict = {}
    for laned in (False, True):
        torch.manual_seed(0)
        first = nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 24))
        second = nn.Sequential(nn.Tanh(), nn.Linear(24, 16), nn.Tanh(), nn.Linear(16, 4))
        engines = []
        for part, spec in ((first, f"csc:0.2:chunk={CHUNK}"), (second, "powersgd:2")):
            comp = build_compressor(spec)
            if not laned:
                comp.wants_lane = False  # this instance only: the engine then makes no lane
            caps = {"bucket_cap_mb": 0.0002, "first_bucket_cap_mb": 0.0002}
            engines.append(DataParallel(part, compression=comp, **caps))
        a, b = engines
        assert a._comm.lane is None and b._comm.lane is None  # no group made in a constructor
        assert len(a.bucket_plan.buckets) > 1 and len(b.bucket_plan.buckets) > 1
        params = [*a.parameters(), *b.parameters()]
        opt = torch.optim.SGD(params, lr=0.05)
        gen = torch.Generator().manual_seed(100 + rank)
        for step in range(STEPS + 2):
            x, y = torch.randn(8, 12, generator=gen), torch.randn(8, 4, generator=gen)
            opt.zero_grad(set_to_none=True)
            F.mse_loss(b(a(x)), y).backward()
            if step == 0:  # each engine's first training forward made its lane
                assert (a._comm.lane is not None, b._comm.lane is not None) == (laned, laned)
            opt.step()
        out[laned] = [p.detach().clone() for p in params]
    return out


def test_two_engines_in_one_graph_each_on_its_own_lane_match_the_run_without_lanes() -> None:
    """Each engine's second collectives go on its own lane, so two engines whose hooks
    interleave in one backward never share a group whose order timing decides: the weights
    equal those of the run without lanes, bit for bit, on every rank."""
    results = run_ranks(_two_engines_rank, 2, timeout_s=120.0)
    for res in results:
        for x, y in zip(res[False], res[True], strict=True):
            assert torch.equal(x, y)
    for x, y in zip(results[0][True], results[1][True], strict=True):
        assert torch.equal(x, y)


# -- CSC owns the momentum: it receives every step's gradient ---------------------------------

MOMENTUM_STEPS = 4


def _momentum_rank(rank: int, world: int) -> dict:
    """CSC dense (density 1, or its dense warm-up) with an fp32 wire, the optimizer without
    momentum, every rank on the same batches (so the rank average is exact): momentum SGD."""
    del rank, world
    out = {}
    specs = {
        "density 1": CSC(1.0, wire_dtype=torch.float32),
        "dense warm-up": CSC(0.01, warmup_steps=MOMENTUM_STEPS, wire_dtype=torch.float32),
    }
    for spec, csc in specs.items():
        model = _seeded_mlp(0)
        dp = DataParallel(model, bucket_cap_mb=0.0005, compression=csc)
        opt = torch.optim.SGD(dp.parameters(), lr=0.1, momentum=0.0)
        for step in range(MOMENTUM_STEPS):
            x, y = _momentum_batch(step)
            opt.zero_grad()
            F.mse_loss(dp(x), y).backward()
            opt.step()
        out[spec] = {k: v.clone() for k, v in model.state_dict().items()}
    return out


def _momentum_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(16, 16, generator=gen), torch.randn(16, 4, generator=gen)


def test_csc_momentum_receives_the_first_steps_gradient_as_momentum_sgd_does() -> None:
    """DataParallel reduces its first step losslessly (its buckets may still be re-laid);
    CSC's momentum buffer still receives that step's gradient, so its dense steps are
    heavy-ball momentum SGD bit for bit (before, the weights after step 1 differed)."""
    model = _seeded_mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(MOMENTUM_STEPS):
        x, y = _momentum_batch(step)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    want = model.state_dict()
    for result in run_ranks(_momentum_rank, 2, timeout_s=60.0):
        for spec, state in result.items():
            for key, value in want.items():
                assert torch.equal(state[key], value), (spec, key)
