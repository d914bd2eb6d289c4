"""Coarse-grained sparse communication (CSC): send only the heaviest chunks, by allreduce.

GradientFlow (Sun, Feng, Han, Yan, Wen 2019, section "coarse-grained sparse communication"),
with Deep Gradient Compression's momentum correction and masking (Lin et al. 2018).
Element-wise top-k needs an allgather whose traffic grows with the number of ranks; CSC
picks whole chunks that *all ranks agree on*, so the payload stays a dense allreduce.

Per bucket and step, on every rank (``g`` = local gradient, ``m`` = momentum)::

    g_i = g_i * min(1, clip/sqrt(p) / ||g_i||)     local clipping per tensor i (if clip > 0)
    u = m*u + g ;  v = v + u                       momentum correction (local)
    k = floor(c + density*N/C) ; c = c + ... - k   this bucket's chunks, c carried on
    s_j = ||v_j||_1 for each chunk j of C elems    score (a short last chunk scaled to C)
    S, B = allreduce_sum(s, max|v| / p)            collective 1: N/C + 1 fp32 values
    J = top k of S                                 same on every rank (ties: lowest index)
    a = 1, or 2**e if B exceeds the wire's range   same on every rank (B bounds every sum)
    x = (v[J] / (p*a)).to(w)                       k chunks of C elements (a short one padded)
    grad = 0 ; grad[J] = a * allreduce_sum(x)      collective 2: packed chunks
    u[J] = 0 ; v[J] = v[J] - p*a * x               masking; the rest (and what rounding to
                                                   w lost) is error feedback

**Chunks sized to the bucket.** By default ``C`` is derived per bucket from its size and the
density (:func:`~syncline.dp.chunk_size.derive_chunk_elems`: the smallest power of two whose
score costs at most a quarter of its payload, ``C >= 8 / density``, but at most one step's
share of the bucket, so every bucket sends at least one chunk every step; 1024 at 1 % on the
GPTs here). Why: with a fixed ``C = 32768`` (the default before), a chunk spanned many small
layers (biases, norms) besides a slice of a weight; at 1 % it was chosen about once in 100
steps and then applied all the velocity it had accumulated meanwhile, up to ~100 steps of
momentum, in one step: on a 4 x 128 GPT at lr 0.1 the first such chunk (10 steps old)
applied an update of norm 148, where the whole model's dense gradient has a norm below 1,
and the loss climbed to NaN (``python -m benchmarks.convergence_long.burst`` measures it).
Smaller chunks alone do not cure that (what arrives late is the problem, not only how
coarse it is); clipping, the residual bound and DGC's warm-up below do.

**Local gradient clipping** (DGC, Lin et al. 2018, section 3.2; ``clip``): each rank clips
each tensor's gradient to ``clip / sqrt(p)`` *before* it enters ``u`` and ``v``, so that an
outlier gradient does not sit in the residual and come back at every later step until sent.

**The density holds over the whole gradient.** Each bucket owns ``density * N/C`` chunks a
step and carries the fraction it cannot send, so a bucket of 8 chunks at 1 % sends one chunk
every 12.5 steps (not one every step, 12.5 %), and the gradient's chunks sent per step are
``density`` of all its chunks within one chunk per bucket; each bucket is still sent as soon
as backward makes it ready. A bucket whose turn has not come sends nothing (all of ``v``
stays). **Nothing overflows or is lost to the wire format**: ``B``, the sum over ranks of
``max |v| / p``, bounds every value sent and every sum of them, so when it exceeds the wire
dtype's range (fp16: 65504) the bucket is scaled down by the power of two ``a`` that brings
``B`` under half the range, on every rank alike, and scaled back on arrival (``a`` is 1, and
changes no bit, otherwise); rounding to fp16 (values below ~6e-8 become 0, or ``6e-8 * a``)
is subtracted from ``v`` only as far as it was sent, so the remainder stays in the residual.

**No host sync.** Everything after the budget ``k`` (an integer of the step and the shapes)
happens on the gradient's device: the selection is exactly ``k`` chunks
(:func:`~.chunks.select_chunks`), the payload exactly ``k * C`` elements (a selected short
last chunk is padded with zeros), and ``a`` a device scalar, so no value is read on the host
to size, place or type what goes on the wire. (Until this was so, a bucket past fp16's range
travelled in fp32, which needed the bound on the host; the scaling replaced it.)

Collective 2 depends on collective 1's result; :class:`~._pending.PhaseOrder` issues it in a
rank-independent order that keeps overlapping backward (see there). During the dense warm-up
(``step < warmup_steps``, with ``ramp="dense"``), or at density 1, the scores are skipped
and the whole of ``v`` is sent (after the bound, unless the wire is fp32); ``v`` keeps only
what rounding lost but ``u`` is kept,
so a dense step is exactly heavy-ball momentum SGD (``u`` is the momentum buffer, ``v = u`` is
the update) and the warm-up trains like the uncompressed optimizer it replaces. (Masking ``u``
too, as the sparse steps do, would throw the momentum away at every dense step.)

With ``ramp="exp"`` the warm-up is DGC's instead (Lin et al. 2018, "warm-up training": the
sparsity rises exponentially over the first epochs): at step ``t < W`` the density is
``density ** (t / W)``, from 1 (dense) down to ``density`` at ``W``, so the model leaves the
dense regime gradually rather than in one jump, so a shorter warm-up reaches the loss a
longer dense one does (``tests/dist/test_convergence.py`` holds it to its floor).

Bytes on the wire per rank and bucket of ``n`` elements, ``N = ceil(n/C)`` chunks, ``k``
of them due, wire element size ``w`` (2 for fp16 and bf16, 4 for fp32)::

    sparse:  4*(N + 1)  +  w * k * C
    dense:   4 + w * n   (fp32 wire: 4 * n, one collective)
    not due: 0
"""

from __future__ import annotations

import math
from typing import Any

import torch

from syncline.comm.collectives import Collective, Pending, completed
from syncline.dp.compression import BucketRef
from syncline.dp.compressors import chunks as ch
from syncline.dp.compressors._pending import PhaseOrder, chain
from syncline.dp.compressors._state import (
    check_numel,
    load_buckets,
    save_buckets,
    to_device,
)
from syncline.errors import ConfigError
from syncline.fields import check_float, check_int

_WIRE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: the largest finite value of each wire dtype
_RANGE = {d: float(torch.finfo(d).max) for d in _WIRE_DTYPES}
_RAMPS = ("dense", "exp")


class CSC:
    """Coarse-grained sparse communication with momentum correction and error feedback.

    Args:
        density: fraction of chunks sent per step, ``0 < density <= 1`` (GradientFlow uses
            1 %, 5 %, 10 %).
        chunk_elems: chunk size ``C`` in elements, ``>= 1``; ``None`` (the default): derived per
            bucket from its size and the density (:func:`~.chunks.derive_chunk_elems`: 1024
            for the buckets of a GPT at 1 %), so that every bucket sends at least one chunk
            every step and the scores cost at most a quarter of the payload.
        warmup_steps: steps with ``BucketRef.step < warmup_steps`` are sent dense; the
            engine's step 0 is always dense, so ``warmup_steps=W`` means ``max(W, 1)`` dense
            steps in a DataParallel run.
        ramp: ``"dense"`` (default): the warm-up steps send everything; ``"exp"``: their
            density falls from 1 to ``density`` as ``density ** (step / warmup_steps)``.
        momentum: local momentum ``m``, ``0 <= m < 1``; set the optimizer's momentum to 0.
        clip: DGC's local gradient clipping: before it enters the momentum, each rank scales
            each parameter's gradient (each tensor of the bucket's layout; the whole bucket
            without one) down to an L2 norm of at most ``clip / sqrt(world size)``, as
            ``torch.nn.utils.clip_grad_norm_`` would; ``0`` (the default) clips nothing.
            A gradient the engine reduced losslessly (:meth:`absorb`) enters unclipped,
            as it was applied.
        bound: a bound on the residual: after the accumulation, each tensor's ``v`` is
            scaled down to an L2 norm of at most ``bound`` times that of its momentum ``u``
            (at most ``bound`` steps of its current velocity wait to be sent); ``0`` (the
            default) bounds nothing.
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
    #: the payload depends on the scores: a second lane lets it start as they arrive
    wants_lane = True

    def __init__(
        self,
        density: float,
        chunk_elems: int | None = None,
        warmup_steps: int = 0,
        momentum: float = 0.9,
        wire_dtype: torch.dtype = torch.float16,
        ramp: str = "dense",
        clip: float = 0.0,
        bound: float = 0.0,
    ) -> None:
        check_float("CSC: density", density, above=0, at_most=1)
        self.chunk_elems = (
            None if chunk_elems is None else check_int("CSC: chunk_elems", chunk_elems)
        )
        check_float("CSC: clip", clip, at_least=0)
        self.clip = float(clip)
        check_float("CSC: bound", bound, at_least=0)
        self.bound = float(bound)
        self.warmup_steps = check_int("CSC: warmup_steps", warmup_steps, low=0)
        check_float("CSC: momentum", momentum, at_least=0, below=1)
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
        self._chunks: dict[int, int] = {}  # bucket numel -> derived chunk size
        self._buckets: dict[int, dict[str, torch.Tensor]] = {}
        self._order = PhaseOrder()

    def __repr__(self) -> str:
        return (
            f"CSC(density={self.density}, chunk_elems={self.chunk_elems}, "
            f"warmup_steps={self.warmup_steps}, momentum={self.momentum}, "
            f"wire_dtype={self.wire_dtype}, ramp={self.ramp!r}, clip={self.clip}, "
            f"bound={self.bound})"
        )

    def density_at(self, step: int) -> float:
        """The density used at ``step``: 1 during a dense warm-up, the exponential ramp's
        ``density ** (step / warmup_steps)`` during an ``"exp"`` one, then ``density``."""
        if step >= self.warmup_steps:
            return self.density
        if self.ramp == "dense":
            return 1.0
        return float(self.density ** (step / self.warmup_steps))

    def chunk_size(self, numel: int) -> int:
        """The chunk size ``C`` of a bucket of ``numel`` elements: ``chunk_elems``, or when
        that is ``None`` the one :func:`~.chunks.derive_chunk_elems` derives (a pure function of the
        numel and the density: the same on every rank, and across a checkpoint)."""
        if self.chunk_elems:
            return self.chunk_elems
        size = self._chunks.get(numel)
        if size is None:
            size = self._chunks[numel] = ch.derive_chunk_elems(numel, self.density)
        return size

    def _clip(self, bucket: BucketRef, grad: torch.Tensor, world: int) -> None:
        """DGC's local gradient clipping (Lin et al. 2018, section 3.2), in place: each
        parameter's gradient in the bucket, on this rank, scaled to an L2 norm of at most
        ``clip / sqrt(world)``, with ``torch.nn.utils.clip_grad_norm_``'s arithmetic
        (``min(1, limit / (norm + 1e-6))``) per tensor. Why ``sqrt(world)``: the ranks' noise
        adds up in the sum, so local gradients clipped there sum to about ``clip``. Why
        before the accumulation: a single outlier gradient would otherwise stay in the
        residual and the momentum, and come back in every later step until it is sent.
        On the device, no host read: the norms are one ``_foreach_norm``."""
        limit = self.clip / math.sqrt(world)
        views = [grad[o : o + math.prod(shape)] for o, shape in bucket.layout] or [grad]
        norms = torch.stack(torch._foreach_norm(views))
        scales = (limit / (norms + 1e-6)).clamp_(max=1.0)
        torch._foreach_mul_(views, list(scales.unbind(0)))

    def _bound(self, bucket: BucketRef, u: torch.Tensor, v: torch.Tensor) -> None:
        """The residual bound, in place: each tensor's ``v`` scaled to an L2 norm of at most
        ``bound * ||u||`` (its momentum's). Why: at a density of 1 % a coordinate waits
        about 100 steps for its turn, and meanwhile ``v`` sums the velocity computed at
        parameters that no longer move; sent at once, that sum overshoots (the loss of a
        4 x 128 GPT at lr 0.1 climbed to NaN). The bound keeps the freshest ``bound`` steps'
        worth and drops the rest. On the device, no host read."""
        spans = [(o, math.prod(shape)) for o, shape in bucket.layout] or [(0, v.numel())]
        vs = [v[o : o + n] for o, n in spans]
        v_norm = torch.stack(torch._foreach_norm(vs))
        u_norm = torch.stack(torch._foreach_norm([u[o : o + n] for o, n in spans]))
        scales = (self.bound * u_norm / (v_norm + 1e-12)).clamp_(max=1.0)
        torch._foreach_mul_(vs, list(scales.unbind(0)))

    def _state(self, index: int, grad: torch.Tensor) -> dict[str, torch.Tensor]:
        state = self._buckets.get(index)
        if state is None:
            state = {"u": torch.zeros_like(grad), "v": torch.zeros_like(grad)}
            self._buckets[index] = state
        check_numel("CSC", index, state["u"], grad.numel())
        to_device(state, grad.device, host=("credit",))  # restored state: still on the CPU
        return state

    def _accumulate(self, index: int, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Momentum correction ``u = m*u + g; v = v + u``; returns ``(u, v)``."""
        state = self._state(index, grad)
        u, v = state["u"], state["v"]
        u.mul_(self.momentum).add_(grad)  # as torch.optim.SGD's buffer, to the last bit
        v.add_(u)
        return u, v

    def absorb(self, index: int, grad: torch.Tensor) -> None:
        """This rank's gradient of a step bucket ``index`` was reduced without CSC
        (DataParallel's lossless first step, a DDP hook's first backward) enters the momentum
        all the same, ``u = m*u + g``, so that the momentum receives every step's gradient, as
        momentum SGD's buffer does; ``v`` is left as it is (a lossless dense step sent all of
        ``u`` exactly and leaves nothing to feed back)."""
        self._state(index, grad)["u"].mul_(self.momentum).add_(grad)

    def _budget(self, index: int, step: int, n_chunks: int) -> int:
        """Chunks bucket ``index`` sends at ``step``: its share ``density * n_chunks`` added to
        the fraction it has carried, rounded down; the fraction left is carried on. So every
        bucket, and the whole gradient, sends ``density`` of its chunks on average (within
        one chunk per bucket at any time), a small bucket one chunk every few steps rather
        than one chunk every step. The same integers on every rank: no communication."""
        # a host counter (read on the host every step, so never moved to the device)
        credit = self._buckets[index].setdefault(
            "credit", torch.zeros((), dtype=torch.float64, device="cpu")
        )
        density = self.density_at(step)
        if density >= 1.0:
            credit.zero_()
            return n_chunks
        total = float(credit) + density * n_chunks
        k = min(n_chunks, math.floor(total * (1.0 + 1e-12)))  # 0.07 * 100 is 7, not 6.99..
        credit.fill_(max(total - k, 0.0))
        return k

    def reduce(self, bucket: BucketRef, grad: torch.Tensor, comm: Collective) -> Pending:
        if self.clip:
            self._clip(bucket, grad, comm.world_size)
        u, v = self._accumulate(bucket.index, grad)
        if self.bound:
            self._bound(bucket, u, v)
        chunk = self.chunk_size(grad.numel())
        n_chunks = ch.num_chunks(grad.numel(), chunk)
        k = self._budget(bucket.index, bucket.step, n_chunks)
        where = f"bucket {bucket.index} at step {bucket.step}"
        if k == 0:  # its turn has not come: everything stays in the residual
            self.last_selection[bucket.index] = torch.empty(
                0, dtype=torch.int64, device=grad.device
            )
            grad.zero_()
            self._order.single()
            return completed(f"csc (nothing due) {where}")
        dense = k == n_chunks
        if dense and self.wire_dtype == torch.float32:  # nothing to round, nothing to bound
            return self._dense_fp32(bucket.index, grad, v, n_chunks, comm, f"csc dense {where}")
        world = comm.world_size
        # max |v| without a |v| copy of the bucket (no allocation); one pass over the bucket
        low, high = torch.aminmax(v.detach())
        bound = torch.maximum(high, -low).reshape(1).float() / world
        # dense: the bound is all phase one carries; sparse: the chunk scores, then the bound
        head = bound if dense else torch.cat([ch.chunk_scores(v, chunk, normalise=True), bound])
        first = comm.allreduce(head, f"csc {'bound' if dense else 'scores'} of {where}")
        sent: list[torch.Tensor] = []  # [selected, payload, up]: set by phase two

        def launch_payload(lane: Collective) -> Pending:
            selected = (
                torch.arange(n_chunks, device=grad.device)
                if dense
                else ch.select_chunks(head[:-1], k)
            )
            self.last_selection[bucket.index] = selected
            payload, up = self._to_wire(u, v, selected, head[-1:], world, dense, chunk)
            sent.extend((selected, payload, up))
            return lane.allreduce(payload, f"csc {'dense ' if dense else ''}payload of {where}")

        def finish() -> None:
            selected, payload, up = sent
            if dense:
                torch.mul(payload, up, out=grad)
            else:
                ch.unpack_chunks(payload * up, selected, chunk, grad)

        return self._order.submit(first, launch_payload, finish, f"csc reduction of {where}", comm)

    def _to_wire(
        self,
        u: torch.Tensor,
        v: torch.Tensor,
        selected: torch.Tensor,
        bound: torch.Tensor,
        world: int,
        dense: bool,
        chunk: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The payload in the wire dtype, and the factor ``up`` that undoes its scaling; the
        momentum masking and the error feedback of what was sent (all on the device).

        ``bound`` (summed over ranks) bounds every value sent and every sum of them. Past the
        wire dtype's range, the payload is scaled down by a power of two ``1/up`` that brings
        the bound under half the range, the same on every rank (the bound is); otherwise
        ``up`` is exactly 1 and the arithmetic is that of an unscaled payload, bit for bit.
        """
        limit = _RANGE[self.wire_dtype]
        _, exponent = torch.frexp(bound / (limit / 2))  # bound <= 2**exponent * limit / 2
        up = torch.where(bound <= limit, 1.0, torch.ldexp(torch.ones_like(bound), exponent))
        up = up.to(v.dtype)
        divisor = up * world  # world exactly when up is 1
        packed = v.div(divisor) if dense else ch.pack_chunks(v, selected, chunk).div_(divisor)
        payload = packed.to(self.wire_dtype, copy=True)
        # what rounding to the wire dtype lost stays in the residual (error feedback)
        lost = packed.sub_(payload.float()).mul_(divisor)
        if dense:
            v.copy_(lost)  # u is kept: a dense step is momentum SGD exactly
        else:
            ch.zero_chunks(u, selected, chunk)  # momentum factor masking
            ch.put_chunks(v, selected, chunk, lost)
        return payload, up

    def poll(self) -> None:
        """Issue the payloads whose scores are in (on the collective's lane; never blocks)."""
        self._order.poll()

    def _dense_fp32(
        self, index: int, grad: torch.Tensor, v: torch.Tensor, n_chunks: int, comm: Collective,
        what: str,
    ) -> Pending:  # fmt: skip
        """Send all of ``v`` in fp32 in one collective; keep ``u`` (momentum SGD exactly)."""
        payload = v.div(comm.world_size) if comm.world_size > 1 else v.clone()
        v.zero_()
        self.last_selection[index] = torch.arange(n_chunks, device=grad.device)
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
