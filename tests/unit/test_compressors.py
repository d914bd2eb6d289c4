"""Compressors on one process: chunk arithmetic, error feedback, state, specs and errors.

With no process group running, :class:`FlatAllreduce` is the real world-size-1 collective
(nothing goes on the wire), so every compressor runs its real code path here.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from syncline.comm import FlatAllreduce, Pending
from syncline.dp.compression import BucketRef, Layout, NoCompression
from syncline.dp.compressors import BF16, CSC, FP16, PowerSGD, TopK, build_compressor
from syncline.dp.compressors import chunks as ch
from syncline.dp.compressors.powersgd import is_worth_compressing, matrix_shape, plan_matrices
from syncline.dp.compressors.topk import top_indices, topk_count
from syncline.errors import ConfigError
from tests.zoo.ids import kwargs_id

COMM = FlatAllreduce()


def _reduce(
    comp, grad: torch.Tensor, step: int = 1, index: int = 0, layout: Layout = ()
) -> torch.Tensor:
    out = grad.clone()
    comp.reduce(BucketRef(index, step, layout), out, COMM).wait()
    return out


def _grad(seed: int, n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


# -- chunk arithmetic (pure) -----------------------------------------------------------
@pytest.mark.parametrize(
    ("numel", "chunk", "expected"), [(1, 1, 1), (8, 8, 1), (9, 8, 2), (50, 8, 7), (64, 8, 8)]
)
def test_num_chunks(numel: int, chunk: int, expected: int) -> None:
    assert ch.num_chunks(numel, chunk) == expected


@pytest.mark.parametrize(
    ("density", "n_chunks", "k"),
    [(0.01, 100, 1), (0.07, 100, 7), (0.05, 200, 10), (0.3, 7, 3), (1e-6, 5, 1), (1.0, 9, 9)],
)
def test_chunks_to_send_is_ceil_of_density(density: float, n_chunks: int, k: int) -> None:
    assert ch.chunks_to_send(density, n_chunks) == k


@pytest.mark.parametrize("block", [1, 8, 12, 1 << 20])
def test_chunk_scores_in_blocks_of_rows_equal_the_whole_bucket_at_once(
    block: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Scoring a block of chunks at a time (bounded memory) changes no score, whatever the
    block's size against the chunk's (smaller, a multiple, not a multiple, larger)."""
    v = torch.randn(4 * 9 + 3, generator=torch.Generator().manual_seed(0))
    whole = torch.cat([v[:36].view(9, 4).abs().sum(dim=1), v[36:].abs().sum().reshape(1)])
    monkeypatch.setattr(ch, "_SCORE_BLOCK", block)
    assert torch.equal(ch.chunk_scores(v, 4), whole)


def test_chunk_scores_are_l1_norms_with_a_short_last_chunk() -> None:
    v = torch.tensor([1.0, -2.0, 3.0, -4.0, 5.0])
    assert ch.chunk_scores(v, 2).tolist() == [3.0, 7.0, 5.0]


@pytest.mark.parametrize(
    ("scores", "k", "expected"),
    [
        ([1.0, 3.0, 3.0, 2.0], 2, [1, 2]),
        ([1.0, 3.0, 3.0, 2.0], 1, [1]),  # tie between 1 and 2: lowest index wins
        ([5.0, 5.0, 5.0, 5.0], 2, [0, 1]),
        ([0.0, 0.0, 7.0, 0.0, 0.0], 3, [0, 1, 2]),
        ([2.0, 1.0, 2.0, 1.0, 2.0], 4, [0, 1, 2, 4]),
    ],
)
def test_select_chunks_breaks_ties_by_lowest_index(
    scores: list[float], k: int, expected: list[int]
) -> None:
    assert ch.select_chunks(torch.tensor(scores), k).tolist() == expected


def test_select_chunks_is_deterministic_on_many_ties() -> None:
    scores = torch.ones(1000)
    scores[::7] = 2.0
    picks = {tuple(ch.select_chunks(scores, 200).tolist()) for _ in range(5)}
    assert len(picks) == 1
    chosen = next(iter(picks))
    top = list(range(0, 1000, 7))
    assert list(chosen) == sorted(top + [i for i in range(1000) if i % 7][: 200 - len(top)])


def test_element_mask_covers_the_selected_chunks_only() -> None:
    mask = ch.element_mask(torch.tensor([0, 2]), 3, 2, 5)
    assert mask.tolist() == [True, True, False, False, True]


@settings(max_examples=60, deadline=None)
@given(
    numel=st.integers(1, 300),
    chunk=st.integers(1, 40),
    density=st.floats(0.01, 1.0),
    seed=st.integers(0, 2**16),
)
def test_pack_unpack_round_trip(numel: int, chunk: int, density: float, seed: int) -> None:
    v = _grad(seed, numel)
    n_chunks = ch.num_chunks(numel, chunk)
    k = ch.chunks_to_send(density, n_chunks)
    selected = ch.select_chunks(ch.chunk_scores(v, chunk), k)
    mask = ch.element_mask(selected, n_chunks, chunk, numel)
    payload = ch.pack(v, mask)
    out = torch.full_like(v, 99.0)
    ch.unpack(payload, mask, out)
    assert torch.equal(out, torch.where(mask, v, torch.zeros_like(v)))
    # the chunk-indexed versions CSC uses agree with the element-mask reference; theirs is
    # k*C elements whatever the values (a selected short last chunk padded with zeros)
    sizes = [min(chunk, numel - j * chunk) for j in selected.tolist()]
    rows = ch.pack_chunks(v, selected, chunk).view(k, chunk)
    assert torch.equal(torch.cat([r[:s] for r, s in zip(rows, sizes, strict=True)]), payload)
    assert not any(r[s:].any() for r, s in zip(rows, sizes, strict=True))
    out2 = torch.full_like(v, 99.0)
    ch.unpack_chunks(rows.view(-1), selected, chunk, out2)
    assert torch.equal(out2, out)
    rest = v.clone()
    ch.zero_chunks(rest, selected, chunk)
    assert torch.equal(rest, torch.where(mask, torch.zeros_like(v), v))
    assert payload.numel() == sum(sizes)
    assert len(selected) == k


# -- half width ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("comp", "rel"), [(FP16(), 2.0**-11), (BF16(), 2.0**-8)], ids=["fp16", "bf16"]
)
def test_half_width_round_trip_within_precision(comp, rel: float) -> None:
    g = _grad(0, 1000)
    out = _reduce(comp, g)
    assert out.dtype == torch.float32
    assert torch.equal(out, g.to(comp.wire_dtype).float())
    assert torch.all((out - g).abs() <= rel * g.abs() + 1e-30)


# -- CSC -------------------------------------------------------------------------------
def test_csc_density_one_equals_dense() -> None:
    g = _grad(1, 103)
    csc = CSC(1.0, chunk_elems=8, momentum=0.0, wire_dtype=torch.float32)
    assert torch.equal(_reduce(csc, g), _reduce(NoCompression(), g))
    assert csc.last_selection[0].tolist() == list(range(13))
    state = csc.state_dict()["buckets"][0]
    assert torch.equal(state["u"], g) and not state["v"].any()  # momentum 0: u = g


def test_csc_dense_steps_are_heavy_ball_momentum_sgd() -> None:
    csc = CSC(0.1, chunk_elems=8, warmup_steps=10, momentum=0.9, wire_dtype=torch.float32)
    buf = torch.zeros(40)
    for step in range(1, 5):
        g = _grad(60 + step, 40)
        buf = 0.9 * buf + g  # torch.optim.SGD's momentum buffer (dampening 0)
        torch.testing.assert_close(_reduce(csc, g, step), buf, atol=0, rtol=1e-6)


def test_csc_error_feedback_bookkeeping_over_steps() -> None:
    n, chunk, m = 50, 8, 0.9
    csc = CSC(0.3, chunk_elems=chunk, momentum=m, wire_dtype=torch.float32)
    u = torch.zeros(n)
    v = torch.zeros(n)
    for step in range(1, 8):
        g = _grad(step, n)
        u_new = m * u + g
        v_acc = v + u_new
        sent = _reduce(csc, g, step)
        state = csc.state_dict()["buckets"][0]
        selected = csc.last_selection[0]
        # 7 chunks at 30 %: 2.1 due a step, the fraction carried: 2, 2, 2, 2, 2, 2, 3 chunks
        k = int(2.1 * step + 1e-9) - int(2.1 * (step - 1) + 1e-9)
        scores = ch.chunk_scores(v_acc, chunk, normalise=True)  # the 2-element tail scaled x4
        assert selected.tolist() == ch.select_chunks(scores, k).tolist()
        mask = ch.element_mask(selected, 7, chunk, n)
        # what was sent plus what stays is exactly what had accumulated
        assert torch.equal(sent + state["v"], v_acc)
        assert torch.equal(sent, torch.where(mask, v_acc, torch.zeros(n)))
        # momentum factor masking: u is zeroed on the sent chunks, kept elsewhere
        assert torch.equal(state["u"], torch.where(mask, torch.zeros(n), u_new))
        u, v = state["u"], state["v"]


def test_csc_density_holds_over_the_whole_gradient_across_buckets() -> None:
    """Buckets of 8, 3 and 100 chunks at 5 %: each sends density x its chunks on average
    (the small ones every few steps, not every step), and the total within one chunk per
    bucket of 5 % of all chunks at every step."""
    csc = CSC(0.05, chunk_elems=4, momentum=0.0, wire_dtype=torch.float32)
    sizes = [32, 12, 400]
    sent = [0, 0, 0]
    for step in range(1, 41):
        for b, n in enumerate(sizes):
            _reduce(csc, _grad(100 * step + b, n), step, index=b)
            sent[b] += csc.last_selection[b].numel()
        for b, n in enumerate(sizes):
            assert abs(sent[b] - 0.05 * (n // 4) * step) < 1.0 + 1e-9, (step, b, sent)
    assert sent == [16, 6, 200]  # 5 % of 8, 3 and 100 chunks over 40 steps


def test_csc_warmup_sends_everything_with_the_same_bookkeeping() -> None:
    g = _grad(2, 40)
    csc = CSC(0.1, chunk_elems=8, warmup_steps=3, momentum=0.5, wire_dtype=torch.float32)
    assert torch.equal(_reduce(csc, g, step=2), g)
    assert csc.last_selection[0].tolist() == [0, 1, 2, 3, 4]
    # 5 chunks at 10 %: half a chunk due at step 3 (nothing sent, all kept), one at step 4
    assert not _reduce(csc, g, step=3).any() and csc.last_selection[0].numel() == 0
    sparse = _reduce(csc, g, step=4)
    assert csc.last_selection[0].numel() == 1
    assert (sparse != 0).sum() == 8


@pytest.mark.parametrize(
    ("ramp", "densities"),
    [
        ("dense", [1.0, 1.0, 1.0, 1.0, 0.01, 0.01]),
        ("exp", [1.0, 0.1**0.5, 0.1, 0.1**1.5, 0.01, 0.01]),  # 0.01 ** (t / 4)
    ],
)
def test_csc_warmup_ramp(ramp: str, densities: list[float]) -> None:
    csc = CSC(0.01, warmup_steps=4, ramp=ramp)
    got = [csc.density_at(t) for t in range(6)]
    assert got == pytest.approx(densities, rel=1e-12)


def test_csc_exp_ramp_sends_fewer_chunks_step_by_step() -> None:
    csc = CSC(0.01, chunk_elems=1, warmup_steps=4, momentum=0.0, ramp="exp")
    sent = []
    for step in range(6):
        _reduce(csc, _grad(80 + step, 1000), step)
        sent.append(csc.last_selection[0].numel())
    # 1000 * density_at(step) plus the carried fraction, rounded down
    assert sent == [1000, 316, 100, 31, 10, 10]


def test_csc_fp16_wire_rounds_only_the_sent_values_and_keeps_what_rounding_lost() -> None:
    g = _grad(3, 64)
    g[0] = 1e-9  # below fp16's smallest subnormal: sent as 0, kept in the residual
    csc = CSC(0.5, chunk_elems=8, momentum=0.0)
    out = _reduce(csc, g)
    mask = ch.element_mask(csc.last_selection[0], 8, 8, 64)
    assert bool(mask[0])  # chunk 0 is among the heaviest four
    assert torch.equal(out[mask], g[mask].half().float())
    assert not out[~mask].any()
    v = csc.state_dict()["buckets"][0]["v"]
    assert torch.equal(v[mask], g[mask] - g[mask].half().float())  # rounding error kept
    assert float(v[0]) == pytest.approx(1e-9) and torch.equal(out + v, g)


def test_csc_values_past_fp16_range_are_scaled_into_it_not_sent_as_inf() -> None:
    g = _grad(4, 64)
    g[9] = 1e5  # > 65504: fp16 would make it inf
    for spec_density in (0.5, 1.0):  # sparse, and dense (density 1)
        csc = CSC(spec_density, chunk_elems=8, momentum=0.0)
        out = g.clone()
        csc.reduce(BucketRef(0, 1), out, _Recording()).wait()
        mask = ch.element_mask(csc.last_selection[0], 8, 8, 64)
        assert torch.isfinite(out).all() and bool(mask[9])
        # scaled by 1/4 (1e5 / 4 < 65504 / 2), rounded to fp16, scaled back (2 ranks:
        # test_compression_dist)
        assert torch.equal(out[mask], (g[mask] / 4).half().float() * 4)
        assert torch.equal(out + csc.state_dict()["buckets"][0]["v"], g)  # rounding kept


class _Recording:
    """The real collective, with a log of what was issued (to check the issue order)."""

    def __init__(self) -> None:
        self.inner = FlatAllreduce()
        self.log: list[str] = []
        self.rank, self.world_size, self.timeout_s = 0, 1, 10.0

    def allreduce(self, tensor: torch.Tensor, what: str) -> Pending:
        self.log.append(what.removesuffix(" at step 1"))
        return self.inner.allreduce(tensor, what)

    def allgather(self, tensor: torch.Tensor, what: str) -> tuple[Pending, list[torch.Tensor]]:
        self.log.append(what)
        return self.inner.allgather(tensor, what)


@pytest.mark.parametrize("wait_order", [[0, 1, 2], [2, 1, 0], [1, 0, 2]])
def test_two_phase_issue_order_depends_on_call_order_only(wait_order: list[int]) -> None:
    comm = _Recording()
    csc = CSC(0.25, chunk_elems=4, momentum=0.0, wire_dtype=torch.float32)
    grads = [_grad(i, 32) for i in range(3)]
    pendings = [csc.reduce(BucketRef(i, 1), grads[i], comm) for i in range(3)]
    # bucket b's scores go out before bucket b-1's payload (see _pending.PhaseOrder)
    assert comm.log == [
        "csc scores of bucket 0",
        "csc scores of bucket 1",
        "csc payload of bucket 0",
        "csc scores of bucket 2",
        "csc payload of bucket 1",
    ]
    for i in wait_order:
        pendings[i].wait()
    assert comm.log[5:] == ["csc payload of bucket 2"]
    for i in range(3):
        assert (grads[i] != 0).sum() == 8


# -- TopK ------------------------------------------------------------------------------
def test_topk_error_feedback_keeps_exactly_what_was_not_sent() -> None:
    n = 200
    topk = TopK(0.05)
    residual = torch.zeros(n)
    for step in range(1, 5):
        g = _grad(10 + step, n)
        acc = residual + g
        sent = _reduce(topk, g, step)
        residual = topk.state_dict()["buckets"][0]["residual"]
        assert torch.equal(sent + residual, acc)
        assert int((sent != 0).sum()) == topk_count(0.05, n) == 10
        kept = acc[sent == 0].abs().max()
        assert torch.all(sent[sent != 0].abs() >= kept)


@pytest.mark.parametrize(
    ("n", "k", "kind"),
    [
        (100_000, 1000, "normal"),
        (100_000, 1000, "ramp"),  # sorted input: the strided sample sees every 64th rank
        (100_000, 1000, "equal"),  # all tied: every entry is a candidate
        (100_000, 3, "normal"),
        (100_000, 30_000, "normal"),  # k too large for the shortcut: full topk
        (1000, 10, "normal"),  # too small for the shortcut
        (100_000, 1000, "spike"),  # few large values: fewer candidates than k, fallback
    ],
)
def test_top_indices_is_the_exact_top_k(n: int, k: int, kind: str) -> None:
    mag = {
        "normal": _grad(70, n).abs(),
        "ramp": torch.arange(n, dtype=torch.float32),
        "equal": torch.ones(n),
        "spike": torch.zeros(n).index_fill_(0, torch.arange(0, n, 97), 1.0),
    }[kind]
    got = top_indices(mag, k)
    assert got.numel() == k and got.unique().numel() == k
    kth = torch.topk(mag, k).values.min()
    assert torch.all(mag[got] >= kth)  # nothing smaller than the k-th largest was picked


@pytest.mark.parametrize(("ratio", "n", "k"), [(0.01, 100, 1), (0.07, 100, 7), (1e-9, 10, 1)])
def test_topk_count(ratio: float, n: int, k: int) -> None:
    assert topk_count(ratio, n) == k


# -- PowerSGD --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("numel", "shape"),
    [(1, (1, 1)), (10, (3, 4)), (16, (4, 4)), (17, (4, 5)), (1000, (32, 32)), (1025, (32, 33))],
)
def test_matrix_shape_is_near_square_with_little_padding(numel: int, shape: tuple) -> None:
    rows, cols = matrix_shape(numel)
    assert (rows, cols) == shape
    assert 0 <= rows * cols - numel < cols


def test_powersgd_recovers_a_low_rank_bucket_exactly() -> None:
    rows, cols = matrix_shape(900)
    a, b = _grad(4, rows), _grad(5, cols)
    g = torch.outer(a, b).flatten()[:900]  # rank 1 (padding is the last zeros)
    out = _reduce(PowerSGD(rank=2), g)
    torch.testing.assert_close(out, g, atol=1e-5, rtol=1e-5)


def test_powersgd_error_feedback_and_warm_start() -> None:
    ps = PowerSGD(rank=2)
    residual = torch.zeros(400)
    q_before = None
    for step in range(1, 4):
        g = _grad(20 + step, 400)
        out = _reduce(ps, g, step)
        state = ps.state_dict()["buckets"][0]
        torch.testing.assert_close(out + state["residual"], residual + g, atol=1e-5, rtol=0)
        if q_before is not None:
            assert not torch.equal(q_before, state["q"])  # Q moves: warm start is updated
        residual, q_before = state["residual"], state["q"]


def test_powersgd_small_buckets_and_warmup_are_dense() -> None:
    assert not is_worth_compressing(4, 4, 4) and is_worth_compressing(20, 20, 4)
    g = _grad(6, 16)
    assert torch.equal(_reduce(PowerSGD(rank=4), g), g)
    big = _grad(7, 400)
    assert torch.equal(_reduce(PowerSGD(rank=4, warmup_steps=5), big, step=4), big)


def test_powersgd_initial_q_depends_on_seed_and_bucket_only() -> None:
    g = _grad(8, 400)

    def q_after_one_step(seed: int, index: int) -> torch.Tensor:
        ps = PowerSGD(rank=2, seed=seed)
        ps.reduce(BucketRef(index, 1), g.clone(), COMM).wait()
        return ps.state_dict()["buckets"][index]["q"]

    assert torch.equal(q_after_one_step(0, 3), q_after_one_step(0, 3))
    assert not torch.equal(q_after_one_step(0, 3), q_after_one_step(0, 4))
    assert not torch.equal(q_after_one_step(0, 3), q_after_one_step(1, 3))


def test_powersgd_survives_a_zero_bucket() -> None:
    ps = PowerSGD(rank=2)
    assert not _reduce(ps, torch.zeros(400)).any()  # Q becomes 0, and P = M Q = 0 next
    g = _grad(9, 400)
    out = _reduce(ps, g, step=2)
    assert torch.isfinite(out).all() and out.any()


# -- PowerSGD per tensor ----------------------------------------------------------------
MLP_LAYOUT: Layout = ((0, (32, 16)), (512, (32,)), (544, (4, 32)), (672, (4,)))


@pytest.mark.parametrize(
    ("numel", "layout", "rank", "matrices", "dense"),
    [
        # a 32x16 weight is compressed; its bias, the 4x32 head (2*36*2 >= 128) and the
        # head's bias are sent dense, merged into one range
        pytest.param(676, MLP_LAYOUT, 2, [(0, 32, 16, 2, 0, 0)], [(512, 676)], id="mlp-rank2"),
        pytest.param(
            676,
            MLP_LAYOUT,
            1,
            [(0, 32, 16, 1, 0, 0), (544, 4, 32, 1, 32, 16)],
            [(512, 544), (672, 676)],
            id="mlp-rank1",
        ),
        # a conv kernel is viewed as out_channels x (in * kh * kw)
        pytest.param(
            224, ((0, (8,)), (8, (8, 3, 3, 3))), 1, [(8, 8, 27, 1, 0, 0)], [(0, 8)], id="conv"
        ),
        pytest.param(5, ((0, ()), (1, (4,))), 1, [], [(0, 5)], id="scalar-and-vector"),
        # a bare buffer: one near-square matrix
        pytest.param(900, (), 2, [(0, 30, 30, 2, 0, 0)], [], id="bare-buffer"),
        # 3x4 is too small to gain from rank 1 at rate 2
        pytest.param(10, (), 1, [], [(0, 10)], id="bare-buffer-too-small"),
    ],
)
def test_plan_matrices_table(numel, layout, rank, matrices, dense) -> None:
    plan = plan_matrices(numel, layout, rank)
    got = [(m.offset, m.rows, m.cols, m.rank, m.p_offset, m.q_offset) for m in plan.matrices]
    assert got == matrices
    assert list(plan.dense) == dense
    assert plan.p_numel == sum(m[1] * m[3] for m in matrices)
    assert plan.q_numel == sum(m[2] * m[3] for m in matrices)
    assert plan.dense_numel == sum(b - a for a, b in dense)


def test_plan_matrices_refuses_a_layout_that_does_not_tile_the_bucket() -> None:
    with pytest.raises(ConfigError, match="does not tile 20 elements"):
        plan_matrices(20, ((0, (4, 4)),), 1)
    with pytest.raises(ConfigError, match="does not tile 20 elements"):
        plan_matrices(20, ((0, (4,)), (8, (12,))), 1)


def _mlp_grad(seed: int, rank1: bool = False) -> torch.Tensor:
    g = _grad(seed, 676)
    if rank1:  # both weights exactly rank 1
        g[:512] = torch.outer(_grad(seed + 1, 32), _grad(seed + 2, 16)).flatten()
        g[544:672] = torch.outer(_grad(seed + 3, 4), _grad(seed + 4, 32)).flatten()
    return g


def test_powersgd_per_tensor_recovers_low_rank_weights_and_sends_the_rest_exactly() -> None:
    g = _mlp_grad(30, rank1=True)
    out = _reduce(PowerSGD(rank=1), g, layout=MLP_LAYOUT)
    torch.testing.assert_close(out, g, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[512:544], g[512:544]) and torch.equal(out[672:], g[672:])


class _Sizes(_Recording):
    """Also records the number of elements of each collective."""

    def __init__(self) -> None:
        super().__init__()
        self.numels: list[int] = []

    def allreduce(self, tensor: torch.Tensor, what: str) -> Pending:
        self.numels.append(tensor.numel())
        return super().allreduce(tensor, what)


def test_powersgd_batches_a_bucket_into_two_collectives() -> None:
    """The uncompressed part and every P in one allreduce, every Q in a second."""
    comm = _Sizes()
    out = _mlp_grad(31)
    pending = PowerSGD(rank=1).reduce(BucketRef(0, 1, MLP_LAYOUT), out, comm)
    pending.wait()  # (bytes on the wire are checked on 2 and 4 ranks, in tests/dist)
    assert comm.log == [
        "powersgd P and uncompressed part of bucket 0",
        "powersgd Q of bucket 0",
    ]
    assert comm.numels == [(32 + 4) + (32 + 4), 16 + 32]


def test_powersgd_per_tensor_error_feedback_and_warm_start() -> None:
    ps = PowerSGD(rank=1)
    residual = torch.zeros(676)
    q_before = None
    for step in range(1, 4):
        g = _mlp_grad(40 + step)
        out = _reduce(ps, g, step, layout=MLP_LAYOUT)
        state = ps.state_dict()["buckets"][0]
        torch.testing.assert_close(out + state["residual"], residual + g, atol=1e-5, rtol=0)
        assert not state["residual"][512:544].any() and not state["residual"][672:].any()
        assert state["q"].shape == (16 + 32,)
        if q_before is not None:
            assert not torch.equal(q_before, state["q"])
        residual, q_before = state["residual"], state["q"]


def test_powersgd_refuses_state_of_other_shapes() -> None:
    ps = PowerSGD(rank=1)
    _reduce(ps, _mlp_grad(50), layout=MLP_LAYOUT)
    other: Layout = ((0, (16, 32)), (512, (164,)))  # same numel, other matrices
    with pytest.raises(ConfigError, match="needs 32 warm-start Q elements but its state has 48"):
        _reduce(ps, _mlp_grad(51), layout=other)


# -- state -----------------------------------------------------------------------------
def _fresh(spec: str):
    comp = build_compressor(spec)
    if isinstance(comp, CSC):
        comp = CSC(comp.density, chunk_elems=8, momentum=0.9)
    return comp


@pytest.mark.parametrize(
    ("spec", "layouts"),
    [
        pytest.param("csc:0.3", ((), ()), id="csc:0.3"),
        pytest.param("topk:0.1", ((), ()), id="topk:0.1"),
        pytest.param("powersgd:2", ((), ()), id="powersgd:2"),
        # per tensor, and a dense bucket
        pytest.param("powersgd:1", (MLP_LAYOUT, ((0, (19, 3)),)), id="powersgd:1-per-tensor"),
        pytest.param("fp16", ((), ()), id="fp16"),
        pytest.param("bf16", ((), ()), id="bf16"),
    ],
)
def test_state_dict_round_trip_continues_bit_identically(spec: str, layouts: tuple) -> None:
    sizes = (400, 57) if not layouts[0] else (676, 57)
    comp = _fresh(spec)
    for step in range(1, 4):
        for b, n in enumerate(sizes):
            _reduce(comp, _grad(100 * step + b, n), step, b, layouts[b])
    saved = comp.state_dict()
    expected = [_reduce(comp, _grad(900 + b, n), 4, b, layouts[b]) for b, n in enumerate(sizes)]
    after = comp.state_dict()

    restored = _fresh(spec)
    restored.load_state_dict(saved)
    got = [_reduce(restored, _grad(900 + b, n), 4, b, layouts[b]) for b, n in enumerate(sizes)]
    for e, g in zip(expected, got, strict=True):
        assert torch.equal(e, g)
    # the checkpoint is a copy, and the continued state matches too
    for b, d in restored.state_dict().get("buckets", {}).items():
        for k, t in d.items():
            assert torch.equal(t, after["buckets"][b][k])
            assert not torch.equal(t, saved["buckets"][b][k]) or not t.any()


def test_state_of_another_layout_is_refused() -> None:
    csc = CSC(0.5, chunk_elems=4)
    _reduce(csc, _grad(0, 32))
    with pytest.raises(ConfigError, match="bucket 0 has 40 elements but its state has 32"):
        _reduce(csc, _grad(0, 40))


# -- specs and validation --------------------------------------------------------------
# (spec, the class it builds, attributes of the built compressor)
SPECS = [
    ("none", NoCompression, {}),
    ("fp16", FP16, {"name": "fp16"}),
    ("BF16", BF16, {"name": "bf16"}),
    ("csc:0.01:chunk=32768", CSC, {"density": 0.01, "warmup_steps": 0, "chunk_elems": 32768}),
    ("csc:0.01:warmup=50", CSC, {"density": 0.01, "warmup_steps": 50}),
    ("csc:0.05:chunk=1024:momentum=0.5", CSC, {"chunk_elems": 1024, "momentum": 0.5}),
    ("csc:0.01:warmup=50:ramp=exp", CSC, {"warmup_steps": 50, "ramp": "exp"}),
    ("csc:0.01", CSC, {"ramp": "dense"}),
    ("csc:0.01", CSC, {"chunk_elems": None, "clip": 0.0, "bound": 0.0}),
    ("csc:0.01:clip=0.1:bound=2", CSC, {"clip": 0.1, "bound": 2.0}),
    ("topk:0.01", TopK, {"ratio": 0.01, "name": "topk"}),
    ("powersgd:4", PowerSGD, {"rank": 4, "warmup_steps": 0, "name": "powersgd"}),
    ("powersgd:2:warmup=10", PowerSGD, {"rank": 2, "warmup_steps": 10}),
    ("powersgd:1:warmup=2:seed=3", PowerSGD, {"rank": 1, "warmup_steps": 2, "seed": 3}),
]


@pytest.mark.parametrize(
    ("spec", "cls", "attrs"),
    SPECS,
    ids=[f"{spec}-{kwargs_id(attrs)}" if attrs else spec for spec, _, attrs in SPECS],
)
def test_build_compressor_parses_specs(spec: str, cls: type, attrs: dict) -> None:
    comp = build_compressor(spec)
    assert type(comp) is cls
    for key, value in attrs.items():
        assert getattr(comp, key) == value


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("zip", "unknown compressor 'zip'"),
        ("csc", "csc needs its density"),
        ("csc:warmup=5", "csc needs its density"),
        ("csc:abc", "density='abc' is not a number"),
        ("csc:0.1:warmup=x", "warmup='x' is not an integer"),
        ("csc:0.1:bogus=1", "unexpected 'bogus=1'"),
        ("csc:0.1:0.2", "unexpected '0.2'"),
        ("csc:0.1:warmup=1:warmup=2", "given twice"),
        ("fp16:3", "unexpected '3'"),
        ("powersgd:2.5", "rank='2.5' is not an integer"),
    ],
)
def test_build_compressor_errors_list_valid_forms(spec: str, why: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_compressor(spec)
    assert why in str(info.value)
    assert "valid forms: none, fp16, bf16, csc:DENSITY" in str(info.value)


# (a call that must raise ConfigError, what its message contains)
INVALID = [
    (lambda: CSC(0.0), "density=0.0 is invalid; valid: a number in (0, 1]"),
    (lambda: CSC(1.5), "density=1.5 is invalid"),
    (lambda: CSC(math.nan), "density=nan is invalid"),
    (lambda: CSC(0.1, chunk_elems=0), "chunk_elems=0 is invalid; valid: an integer >= 1"),
    (lambda: CSC(0.1, warmup_steps=-1), "warmup_steps=-1 is invalid"),
    (
        lambda: CSC(0.1, momentum=1.0),
        "momentum=1.0 is invalid; valid: a number in [0, 1)",
    ),
    (lambda: CSC(0.1, momentum=-0.1), "momentum=-0.1 is invalid"),
    (lambda: CSC(0.1, wire_dtype=torch.int8), "wire_dtype=torch.int8 is not supported"),
    (lambda: CSC(0.1, ramp="linear"), "CSC: ramp='linear' is not supported; valid: dense, exp"),
    (lambda: CSC("0.1"), "density='0.1' is invalid; valid: a number"),  # type: ignore[arg-type]
    (lambda: TopK(0.0), "TopK: ratio=0.0 is invalid; valid: a number in (0, 1]"),
    (lambda: PowerSGD(rank=0), "PowerSGD: rank=0 is invalid; valid: an integer >= 1"),
    (lambda: PowerSGD(warmup_steps=-2), "warmup_steps=-2 is invalid"),
    (lambda: build_compressor("csc:2"), "CSC: density=2.0 is invalid"),
]


@pytest.mark.parametrize(("make", "message"), INVALID, ids=[message for _, message in INVALID])
def test_invalid_arguments_name_the_value_and_range(make, message: str) -> None:
    with pytest.raises(ConfigError, match=None) as info:
        make()
    assert message in str(info.value)


def test_names() -> None:
    names = [c.name for c in (FP16(), BF16(), CSC(0.1), TopK(0.1), PowerSGD())]
    assert names == ["fp16", "bf16", "csc", "topk", "powersgd"]


def test_public_compression_module_names_the_same_classes() -> None:
    """``syncline.compression`` (the path users write) is the engine's compressors, not copies."""
    import syncline.compression as public
    from syncline.dp import compressors

    for name in ("BF16", "CSC", "FP16", "PowerSGD", "TopK", "build_compressor"):
        assert getattr(public, name) is getattr(compressors, name), name
    assert public.build_compressor("fp16").name == "fp16"
