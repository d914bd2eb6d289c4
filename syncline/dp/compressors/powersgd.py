"""PowerSGD: per-tensor rank-r compression by warm-started power iteration, with error feedback.

Vogels, Karimireddy, Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization", NeurIPS 2019, Algorithm 1 with the error feedback of section 3;
batched per bucket as DDP's ``powerSGD_hook`` does. The messages ``P`` and ``Q`` are linear in
the gradient, so they can be *summed* by allreduce (unlike top-k indices), and reusing last
step's ``Q`` makes one iteration per step enough.

Why per tensor: a weight's gradient is close to low rank *as a matrix of that weight* (rows =
output features). Viewing a whole flat bucket (many weights glued end to end) as one square
matrix mixes unrelated rows, so its rank-r approximation is poor; with momentum SGD that made
training diverge on the benchmark GPT (see ``benchmarks/results/NOTES.md``).

Per bucket (``M_i`` = parameter ``i``'s slice of ``g + residual`` viewed as
``shape[0] x prod(shape[1:])``; only matrices where ``r*(a+b)*min_compression_rate < a*b``)::

    D = the other elements (biases, norms, tiny matrices)   sent uncompressed, fp32
    P_i = M_i Q_i                      [D/p, P] = allreduce_sum([D/p, P_1 .. P_k])
    P_i = orthonormal columns of P_i   (QR; same on every rank: P is identical bits)
    Q_i = M_i^T P_i                    local
    residual_i = M_i - P_i Q_i^T       local approximation error, before averaging
    Q = allreduce_sum([Q_1 .. Q_k])/p  collective 2; kept as next step's warm start
    grad_i = P_i Q_i^T                 = mean over ranks of P_i Q_i^T ; grad[D] = mean of D

So a bucket costs two collectives, whatever the number of parameters in it: ``D`` and all
``P`` go out in one message in phase one, all ``Q`` in phase two, ordered by
:class:`~._pending.PhaseOrder`. ``Q`` starts from a seeded normal draw (same seed on every
rank, offset by bucket index). Steps ``< warmup_steps``, and buckets with nothing worth
compressing, are sent dense in fp32 (with any residual folded in). A caller that passes no
layout (a bare buffer) gets the bucket viewed as one near-square matrix (:func:`matrix_shape`).

Bytes on the wire per rank and bucket: compressed ``4*(|D| + sum_i r_i*(a_i+b_i))``;
dense ``4*n``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from syncline.comm.collectives import Collective, Pending
from syncline.dp.compression import BucketRef, Layout
from syncline.dp.compressors._pending import PhaseOrder, chain
from syncline.dp.compressors._state import (
    check_numel,
    load_buckets,
    save_buckets,
    to_device,
)
from syncline.errors import ConfigError
from syncline.fields import check_float, check_int


def matrix_shape(numel: int) -> tuple[int, int]:
    """The near-square ``(a, b)`` a bare flat buffer is viewed as: ``b = ceil(sqrt(n))``,
    ``a = ceil(n / b)``, padded with fewer than ``b`` zeros (used only without a layout).

    Example:
        >>> matrix_shape(10)
        (3, 4)
    """
    cols = max(1, math.isqrt(numel - 1) + 1) if numel > 0 else 1
    rows = max(1, -(-numel // cols))
    return rows, cols


def is_worth_compressing(rows: int, cols: int, rank: int, min_rate: float = 2.0) -> bool:
    """``r*(a+b) * min_rate < a*b`` with ``r = min(rank, a, b)``: DDP's ``_should_compress``.

    The factors must be ``min_rate`` times smaller than the matrix, otherwise the matrix is
    sent uncompressed (it would save little and add approximation error).
    """
    r = min(rank, rows, cols)
    return r * (rows + cols) * min_rate < rows * cols


@dataclass(frozen=True)
class Matrix:
    """One compressed parameter: ``rows x cols`` at ``offset`` in the bucket, rank ``rank``;
    its ``P`` block starts at ``p_offset`` of the bucket's flat ``P``, ``Q`` likewise."""

    offset: int
    rows: int
    cols: int
    rank: int
    p_offset: int
    q_offset: int


@dataclass(frozen=True)
class MatrixPlan:
    """How one bucket is split between low-rank matrices and a dense remainder.

    Attributes:
        numel: elements in the bucket.
        padded: elements the matrices cover, ``>= numel`` only for the bare-buffer fallback.
        matrices: the compressed parameters, in buffer order.
        dense: ``[start, end)`` ranges sent uncompressed, merged where adjacent.
        p_numel, q_numel, dense_numel: sizes of the three messages.
    """

    numel: int
    padded: int
    matrices: tuple[Matrix, ...]
    dense: tuple[tuple[int, int], ...]
    p_numel: int
    q_numel: int
    dense_numel: int


def plan_matrices(numel: int, layout: Layout, rank: int, min_rate: float = 2.0) -> MatrixPlan:
    """Split a bucket into compressed matrices and dense ranges (pure; no tensors).

    Args:
        numel: elements in the bucket.
        layout: ``(offset, shape)`` per parameter (see :class:`BucketRef`); empty means a
            bare buffer, viewed as one :func:`matrix_shape` matrix.
        rank: the requested factor rank.
        min_rate: see :func:`is_worth_compressing`.

    Raises:
        ConfigError: if the layout does not tile ``[0, numel)``.

    Example:
        >>> plan = plan_matrices(70, ((0, (8, 8)), (64, (6,))), rank=1)
        >>> [(m.rows, m.cols, m.rank) for m in plan.matrices], plan.dense
        ([(8, 8, 1)], ((64, 70),))
    """
    shapes: list[tuple[int, tuple[int, ...]]] = list(layout)
    padded = numel
    if not shapes:
        rows, cols = matrix_shape(numel)
        if not is_worth_compressing(rows, cols, rank, min_rate):
            return MatrixPlan(numel, numel, (), ((0, numel),), 0, 0, numel)
        shapes, padded = [(0, (rows, cols))], rows * cols
    matrices: list[Matrix] = []
    dense: list[tuple[int, int]] = []
    cursor = p_off = q_off = 0
    for offset, shape in sorted(shapes):
        size = math.prod(shape)
        if offset != cursor:
            raise ConfigError(f"PowerSGD: layout {list(layout)} does not tile {numel} elements")
        cursor = offset + size
        rows = shape[0] if shape else 1
        cols = size // rows if rows else 0
        if len(shape) >= 2 and is_worth_compressing(rows, cols, rank, min_rate):
            r = min(rank, rows, cols)
            matrices.append(Matrix(offset, rows, cols, r, p_off, q_off))
            p_off, q_off = p_off + rows * r, q_off + cols * r
        elif dense and dense[-1][1] == offset:
            dense[-1] = (dense[-1][0], cursor)
        else:
            dense.append((offset, cursor))
    if cursor != padded:
        raise ConfigError(f"PowerSGD: layout {list(layout)} does not tile {numel} elements")
    dense_numel = sum(b - a for a, b in dense)
    return MatrixPlan(numel, padded, tuple(matrices), tuple(dense), p_off, q_off, dense_numel)


class PowerSGD:
    """Per-tensor low-rank (rank ``r``) gradient compression with warm start and error feedback.

    Args:
        rank: the factor rank ``r >= 1`` (the paper uses 1, 2, 4).
        warmup_steps: steps with ``BucketRef.step < warmup_steps`` are sent dense.
        seed: seed of the initial ``Q`` (must be the same on every rank).
        min_compression_rate: a matrix is compressed only if its factors are this many times
            smaller (DDP's default: 2).

    Raises:
        ConfigError: if ``rank < 1``, ``warmup_steps < 0``, ``seed`` is not an integer, or
            ``min_compression_rate < 1``.

    Example:
        >>> dp = DataParallel(model, compression=PowerSGD(rank=4, warmup_steps=10))
    """

    name = "powersgd"
    stateless = False  # residuals/factors per bucket: the buckets must not be re-cut
    #: Q depends on the allreduced P: a second lane lets it start as P arrives
    wants_lane = True

    def __init__(
        self,
        rank: int = 4,
        warmup_steps: int = 0,
        seed: int = 0,
        min_compression_rate: float = 2.0,
    ) -> None:
        self.rank = check_int("PowerSGD: rank", rank)
        self.warmup_steps = check_int("PowerSGD: warmup_steps", warmup_steps, low=0)
        self.seed = check_int("PowerSGD: seed", seed, low=0)
        check_float(
            "PowerSGD: min_compression_rate", min_compression_rate, at_least=1, finite=False
        )
        self.min_compression_rate = float(min_compression_rate)
        self._buckets: dict[int, dict[str, torch.Tensor]] = {}
        self._plans: dict[tuple[int, Layout], MatrixPlan] = {}
        self._order = PhaseOrder()

    def __repr__(self) -> str:
        return (
            f"PowerSGD(rank={self.rank}, warmup_steps={self.warmup_steps}, seed={self.seed}, "
            f"min_compression_rate={self.min_compression_rate})"
        )

    def plan(self, numel: int, layout: Layout) -> MatrixPlan:
        """The (cached) :class:`MatrixPlan` of a bucket."""
        key = (numel, layout)
        plan = self._plans.get(key)
        if plan is None:
            plan = plan_matrices(numel, layout, self.rank, self.min_compression_rate)
            self._plans[key] = plan
        return plan

    def _state(self, index: int, grad: torch.Tensor, plan: MatrixPlan) -> dict[str, torch.Tensor]:
        state = self._buckets.get(index)
        if state is None:
            # drawn on the CPU, whatever the device: the same Q on every rank and device
            # (a one-off copy at the bucket's first compressed step, not in the steady state)
            gen = torch.Generator(device="cpu").manual_seed(self.seed + index)
            q = torch.randn(plan.q_numel, generator=gen, dtype=grad.dtype, device="cpu")
            q = q.to(grad.device)
            state = {"residual": torch.zeros_like(grad), "q": q}
            self._buckets[index] = state
        check_numel("PowerSGD", index, state["residual"], grad.numel())
        to_device(state, grad.device)  # restored state: still on the CPU
        if state["q"].numel() != plan.q_numel:
            raise ConfigError(
                f"PowerSGD: bucket {index} needs {plan.q_numel} warm-start Q elements but its "
                f"state has {state['q'].numel()}; the parameter shapes or rank changed"
            )
        return state

    def reduce(self, bucket: BucketRef, grad: torch.Tensor, comm: Collective) -> Pending:
        n, world = grad.numel(), comm.world_size
        where = f"bucket {bucket.index} at step {bucket.step}"
        plan = self.plan(n, bucket.layout)
        if bucket.step < self.warmup_steps or not plan.matrices:
            return self._dense(bucket.index, grad, comm, f"powersgd dense {where}")

        state = self._state(bucket.index, grad, plan)
        residual, q = state["residual"], state["q"]
        residual.add_(grad)  # residual now holds M = g + e (the error-fed gradient)
        work = residual
        if plan.padded != n:  # bare buffer: one zero-padded matrix
            work = grad.new_zeros(plan.padded)
            work[:n].copy_(residual)
        mats = [(mt, work[mt.offset : mt.offset + mt.rows * mt.cols]) for mt in plan.matrices]
        # the uncompressed part and P travel in one message: one collective (one latency)
        # for phase one instead of two
        message = grad.new_empty(plan.dense_numel + plan.p_numel)
        dense, p = message[: plan.dense_numel], message[plan.dense_numel :]
        if plan.dense:
            torch.cat([residual[a:b] for a, b in plan.dense], out=dense)
            if world > 1:
                dense.div_(world)
            for a, b in plan.dense:
                residual[a:b].zero_()  # sent in full: nothing left to feed back
        # P and Q are held transposed (r x rows, r x cols): MKL's GEMM is 4-6x faster with the
        # rank as the short *leading* dimension than with skinny (rows x r) outputs.
        for mt, m in mats:
            torch.mm(_q(q, mt), m.view(mt.rows, mt.cols).T, out=_p(p, mt))
        what = f"powersgd P{' and uncompressed part' if plan.dense else ''} of {where}"
        first = comm.allreduce(message, what)
        q_local = torch.empty_like(q)

        def launch_q(lane: Collective) -> Pending:
            for mt, m in mats:
                pt, qt, m2 = _p(p, mt), _q(q_local, mt), m.view(mt.rows, mt.cols)
                pt.copy_(torch.linalg.qr(pt.T, mode="reduced").Q.T)  # orthonormal P
                torch.mm(pt, m2, out=qt)  # Q_local^T = P^T M
                m2.addmm_(pt.T, qt, alpha=-1.0)  # residual = M - P Q_local^T, in place
            if work is not residual:
                residual.copy_(work[:n])
            return lane.allreduce(q_local, f"powersgd Q of {where}")

        def finish() -> None:
            q.copy_(q_local)
            if world > 1:
                q.div_(world)
            out = grad if work is residual else work
            for mt in plan.matrices:
                size = mt.rows * mt.cols
                view = out[mt.offset : mt.offset + size].view(mt.rows, mt.cols)
                torch.mm(_p(p, mt).T, _q(q, mt), out=view)
            if out is not grad:
                grad.copy_(out[:n])
            start = 0
            for a, b in plan.dense:
                grad[a:b].copy_(dense[start : start + b - a])
                start += b - a

        return self._order.submit(first, launch_q, finish, f"powersgd reduction of {where}", comm)

    def poll(self) -> None:
        """Issue the ``Q`` allreduces whose ``P`` is in (on the collective's lane; never
        blocks)."""
        self._order.poll()

    def _dense(self, index: int, grad: torch.Tensor, comm: Collective, what: str) -> Pending:
        state = self._buckets.get(index)
        if state is not None:  # a compressed step came before: send what it kept back
            check_numel("PowerSGD", index, state["residual"], grad.numel())
            to_device(state, grad.device)
            grad.add_(state["residual"])
            state["residual"].zero_()
        if comm.world_size > 1:
            grad.div_(comm.world_size)
        sent = comm.allreduce(grad, what)
        self._order.single()
        return chain([sent], _nothing, what, comm)

    def state_dict(self) -> dict[str, Any]:
        """Residual and warm-start ``Q`` (all matrices, flat) of every compressed bucket."""
        return {"buckets": save_buckets(self._buckets)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._buckets = load_buckets(state.get("buckets", {}), "PowerSGD")


def _p(p: torch.Tensor, mt: Matrix) -> torch.Tensor:
    """Matrix ``mt``'s block of the flat ``P`` message, as ``P^T`` (``rank x rows``)."""
    return p[mt.p_offset : mt.p_offset + mt.rows * mt.rank].view(mt.rank, mt.rows)


def _q(q: torch.Tensor, mt: Matrix) -> torch.Tensor:
    """Matrix ``mt``'s block of the flat ``Q`` message, as ``Q^T`` (``rank x cols``)."""
    return q[mt.q_offset : mt.q_offset + mt.cols * mt.rank].view(mt.rank, mt.cols)


def _nothing() -> None:
    """No local work after the collective (the result is already in place)."""
