"""Coarse-grained sparse communication (CSC): send only the heaviest chunks, by allreduce.

GradientFlow (Sun, Feng, Han, Yan, Wen 2019, section "coarse-grained sparse communication"),
with Deep Gradient Compression's momentum correction and masking (Lin et al. 2018).
Element-wise top-k needs an allgather whose traffic grows with the number of ranks; CSC
picks whole chunks that *all ranks agree on*, so the payload stays a dense allreduce.

Per bucket and step, on every rank (``g`` = local gradient, ``m`` = momentum)::

    u = m*u + g ;  v = v + u                       momentum correction (local)
    s_j = ||v_j||_1 for each chunk j of C elems    score
    S = allreduce_sum(s)                           collective 1: N/C fp32 scores
    J = top ceil(density * N/C) of S               same on every rank (ties: lowest index)
    grad = 0 ; grad[J] = allreduce_sum(v[J] / p)   collective 2: packed chunks, wire dtype
    u[J] = 0 ; v[J] = 0                            masking; the rest is error feedback

Because ``u`` already carries the momentum, the optimizer must run **without** momentum
(``torch.optim.SGD(..., momentum=0)``); otherwise momentum is applied twice.

Collective 2 depends on collective 1's result; :class:`~._pending.PhaseOrder` issues it in a
rank-independent order that keeps overlapping backward (see there). During the dense warm-up
(``step < warmup_steps``, with ``ramp="dense"``), or when every chunk would be selected anyway
(always the case at density 1), the scores are
skipped and the whole of ``v`` is sent in one collective; ``v`` is zeroed but ``u`` is kept,
so a dense step is exactly heavy-ball momentum SGD (``u`` is the momentum buffer, ``v = u`` is
the update) and the warm-up trains like the uncompressed optimizer it replaces. (Masking ``u``
too, as the sparse steps do, would throw the momentum away at every dense step.)

With ``ramp="exp"`` the warm-up is DGC's instead (Lin et al. 2018, "warm-up training": the
sparsity rises exponentially over the first epochs): at step ``t < W`` the density is
``density ** (t / W)``, from 1 (dense) down to ``density`` at ``W``, so the model leaves the
dense regime gradually rather than in one jump, so a shorter warm-up reaches the loss a
longer dense one does (``tests/dist/test_convergence.py`` holds it to its floor).

Bytes on the wire per rank and bucket of ``n`` elements, ``N = ceil(n/C)`` chunks, wire
element size ``w`` (2 for fp16)::

    sparse:  4*N  +  w * (elements in the selected chunks)   (<= 4*N + w*k*C)
    dense:   w * n
"""

from __future__ import annotations

from typing import Any

import torch

from syncline.comm.collectives import Collective, Pending
from syncline.dp.compression import BucketRef
from syncline.dp.compressors import chunks as ch
from syncline.dp.compressors._pending import PhaseOrder, chain
from syncline.dp.compressors._state import (
    check_int,
    check_numel,
    check_range,
    load_buckets,
    save_buckets,
)
from syncline.errors import ConfigError

_WIRE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_RAMPS = ("dense", "exp")


class CSC:
    """Coarse-grained sparse communication with momentum correction and error feedback.

    Args:
        density: fraction of chunks sent per step, ``0 < density <= 1`` (GradientFlow uses
            1 %, 5 %, 10 %).
        chunk_elems: chunk size ``C`` in elements, ``>= 1`` (default 32768).
        warmup_steps: steps with ``BucketRef.step < warmup_steps`` are sent dense; the
            engine's step 0 is always dense, so ``warmup_steps=W`` means ``max(W, 1)`` dense
            steps in a DataParallel run.
        ramp: ``"dense"`` (default): the warm-up steps send everything; ``"exp"``: their
            density falls from 1 to ``density`` as ``density ** (step / warmup_steps)``.
        momentum: local momentum ``m``, ``0 <= m < 1``; set the optimizer's momentum to 0.
        wire_dtype: payload dtype: ``torch.float16`` (default), ``torch.bfloat16`` or
            ``torch.float32``. Scores always travel in fp32.

    Attributes:
        last_selection: bucket index -> the chunk indices sent at its last reduction
            (ascending int64; all chunks for a dense step).

    Raises:
        ConfigError: naming the bad value and the valid range.

    Example:
        >>> dp = DataParallel(model, compression=CSC(0.01, warmup_steps=50))
        >>> opt = torch.optim.SGD(dp.parameters(), lr=0.1, momentum=0.0)
    """

    name = "csc"
    stateless = False  # residuals/factors per bucket: the buckets must not be re-cut

    def __init__(
        self,
        density: float,
        chunk_elems: int = 32768,
        warmup_steps: int = 0,
        momentum: float = 0.9,
        wire_dtype: torch.dtype = torch.float16,
        ramp: str = "dense",
    ) -> None:
        check_range("CSC", "density", density, 0.0, 1.0, lo_open=True)
        self.chunk_elems = check_int("CSC", "chunk_elems", chunk_elems, 1)
        self.warmup_steps = check_int("CSC", "warmup_steps", warmup_steps, 0)
        check_range("CSC", "momentum", momentum, 0.0, 1.0, hi_open=True)
        if wire_dtype not in _WIRE_DTYPES:
            raise ConfigError(
                f"CSC: wire_dtype={wire_dtype} is not supported; valid: "
                + ", ".join(str(d) for d in _WIRE_DTYPES)
            )
        if ramp not in _RAMPS:
            raise ConfigError(f"CSC: ramp={ramp!r} is not supported; valid: {', '.join(_RAMPS)}")
        self.ramp = ramp
        self.density = float(density)
        self.momentum = float(momentum)
        self.wire_dtype = wire_dtype
        self.last_selection: dict[int, torch.Tensor] = {}
        self._buckets: dict[int, dict[str, torch.Tensor]] = {}
        self._order = PhaseOrder()

    def __repr__(self) -> str:
        return (
            f"CSC(density={self.density}, chunk_elems={self.chunk_elems}, "
            f"warmup_steps={self.warmup_steps}, momentum={self.momentum}, "
            f"wire_dtype={self.wire_dtype}, ramp={self.ramp!r})"
        )

    def density_at(self, step: int) -> float:
        """The density used at ``step``: 1 during a dense warm-up, the exponential ramp's
        ``density ** (step / warmup_steps)`` during an ``"exp"`` one, then ``density``."""
        if step >= self.warmup_steps:
            return self.density
        if self.ramp == "dense":
            return 1.0
        return float(self.density ** (step / self.warmup_steps))

    def _accumulate(self, index: int, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Momentum correction ``u = m*u + g; v = v + u``; returns ``(u, v)``."""
        state = self._buckets.get(index)
        if state is None:
            state = {"u": torch.zeros_like(grad), "v": torch.zeros_like(grad)}
            self._buckets[index] = state
        u, v = state["u"], state["v"]
        check_numel("CSC", index, u, grad.numel())
        u.mul_(self.momentum).add_(grad)
        v.add_(u)
        return u, v

    def reduce(self, bucket: BucketRef, grad: torch.Tensor, comm: Collective) -> Pending:
        u, v = self._accumulate(bucket.index, grad)
        n_chunks = ch.num_chunks(grad.numel(), self.chunk_elems)
        k = ch.chunks_to_send(self.density_at(bucket.step), n_chunks)
        where = f"bucket {bucket.index} at step {bucket.step}"
        if k == n_chunks:
            return self._dense(bucket.index, grad, v, n_chunks, comm, f"csc dense {where}")

        chunk = self.chunk_elems
        scores = ch.chunk_scores(v, chunk)
        first = comm.allreduce(scores, f"csc scores of {where}")
        world = comm.world_size
        selected = torch.empty(0, dtype=torch.int64)
        payload = torch.empty(0)

        def launch_payload() -> Pending:
            nonlocal selected, payload
            selected = ch.select_chunks(scores, k)
            self.last_selection[bucket.index] = selected
            packed = ch.pack_chunks(v, selected, chunk)
            if world > 1:
                packed.div_(world)
            payload = packed.to(self.wire_dtype)
            ch.zero_chunks(u, selected, chunk)  # momentum factor masking
            ch.zero_chunks(v, selected, chunk)
            return comm.allreduce(payload, f"csc payload of {where}")

        def finish() -> None:
            ch.unpack_chunks(payload, selected, chunk, grad)

        return self._order.submit(first, launch_payload, finish, f"csc reduction of {where}")

    def _dense(
        self,
        index: int,
        grad: torch.Tensor,
        v: torch.Tensor,
        n_chunks: int,
        comm: Collective,
        what: str,
    ) -> Pending:
        """Send all of ``v``; keep ``u`` (see the module docstring: momentum SGD exactly)."""
        if comm.world_size > 1:
            payload = v.div(comm.world_size).to(self.wire_dtype)
        else:
            payload = v.to(self.wire_dtype, copy=True)
        v.zero_()
        self.last_selection[index] = torch.arange(n_chunks)
        sent = comm.allreduce(payload, what)
        self._order.single()

        def finish() -> None:
            grad.copy_(payload)

        return chain([sent], finish, what, comm)

    def state_dict(self) -> dict[str, Any]:
        """Momentum ``u`` and accumulator ``v`` per bucket (the step comes from the engine)."""
        return {"buckets": save_buckets(self._buckets)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._buckets = load_buckets(state.get("buckets", {}), "CSC")
