"""Element-wise top-k sparsification with error feedback: the baseline CSC improves on.

Deep Gradient Compression (Lin et al. 2018) and sparsified SGD with memory (Stich et al.
2018): each rank sends its own ``k`` largest-magnitude entries of ``g + residual`` and keeps
the rest for later. Ranks choose different indices, so the exchange cannot be a sum
allreduce; it is an allgather of ``(values, indices)``, and what each rank receives grows with
the number of ranks ``p`` (GradientFlow's argument for CSC).

Per bucket and step::

    a = residual + g
    I = indices of the k = ceil(ratio * n) largest |a|      (local, different per rank)
    gather (a[I], I) from every rank                        one allgather
    grad = (sum over ranks r of scatter(I_r, a_r)) / p      summed in rank order
    residual = a ; residual[I] = 0                          error feedback

Bytes on the wire per rank and bucket: ``k * (4 + i)``, with ``i = 4`` (int32 indices) for
buckets below 2**31 elements and 8 otherwise. Each rank *receives* ``(p-1)`` times that.
``k`` comes from the ratio and the bucket's size alone, so on a GPU the step has no host
sync: selection, packing and the scatter-add of what arrives all stay on the device.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from syncline.comm.collectives import Collective, Pending
from syncline.dp.compression import BucketRef
from syncline.dp.compressors._pending import chain
from syncline.dp.compressors._state import (
    check_numel,
    load_buckets,
    save_buckets,
    to_device,
)
from syncline.fields import check_float

_INT32_LIMIT = 2**31 - 1


def topk_count(ratio: float, numel: int) -> int:
    """``ceil(ratio * numel)`` entries, at least 1 and at most ``numel``."""
    return max(1, min(numel, math.ceil(ratio * numel * (1.0 - 1e-9))))


_SAMPLE_STRIDE = 64


def top_indices(mag: torch.Tensor, k: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Indices of the ``k`` largest entries of ``mag`` (``>= 0``), in no particular order:
    always exactly ``k`` of them (``k`` comes from shapes, so nothing is sized by values).

    Off the CPU this is ``torch.topk`` (on a GPU a radix select, no host sync). On the CPU
    it returns the same set (up to which of equal values at the boundary is kept) several
    times faster for ``k`` around 1 % of a large bucket: a threshold ``t`` is read off a
    strided sample (every 64th entry, with a 2x margin), one pass keeps the candidates
    ``mag >= t``, and the exact top-k is taken among them. It is exact because every entry
    left out is ``< t <=`` every candidate; when fewer than ``k`` entries pass (an unlucky
    sample), the full ``topk`` runs instead. That path counts its candidates with
    ``nonzero``, which on a device would stall the host until the count is known, and on
    the CPU reads memory the host holds anyway (no device to wait for). ``mask``, a bool
    tensor of ``mag``'s shape, takes the candidates' mask instead of a fresh allocation.
    """
    n = mag.numel()
    if mag.device.type != "cpu" or n < 64 * _SAMPLE_STRIDE or 4 * k > n:
        return torch.topk(mag, k, sorted=False).indices
    sample = mag[::_SAMPLE_STRIDE]
    want = min(sample.numel(), 2 * (k // _SAMPLE_STRIDE) + 1)
    threshold = torch.topk(sample, want, sorted=False).values.min()
    passed = mag >= threshold if mask is None else torch.ge(mag, threshold, out=mask)
    candidates = torch.nonzero(passed).squeeze(1)  # CPU only (see above)
    if candidates.numel() < k:
        return torch.topk(mag, k, sorted=False).indices
    return candidates[torch.topk(mag[candidates], k, sorted=False).indices]


class TopK:
    """Per-rank top-k of ``|g + residual|`` exchanged by allgather, with error feedback.

    Args:
        ratio: fraction of the elements each rank sends, ``0 < ratio <= 1``.

    Raises:
        ConfigError: if ``ratio`` is out of range.

    Example:
        >>> dp = DataParallel(model, compression=TopK(0.01))
    """

    name = "topk"
    stateless = False  # residuals/factors per bucket: the buckets must not be re-cut

    def __init__(self, ratio: float) -> None:
        check_float("TopK: ratio", ratio, above=0, at_most=1)
        self.ratio = float(ratio)
        self._buckets: dict[int, dict[str, torch.Tensor]] = {}
        # |a| and the candidates' mask of the bucket being reduced, reused by every bucket
        # (one at a time): a fresh bucket-sized temporary each call is a large allocation
        # whose pages are faulted in anew, which in training cost more than the top-k itself
        self._scratch: tuple[torch.Tensor, torch.Tensor] | None = None

    def __repr__(self) -> str:
        return f"TopK(ratio={self.ratio})"

    def _residual(self, index: int, grad: torch.Tensor) -> torch.Tensor:
        state = self._buckets.setdefault(index, {"residual": torch.zeros_like(grad)})
        check_numel("TopK", index, state["residual"], grad.numel())
        to_device(state, grad.device)  # restored state: still on the CPU
        return state["residual"]

    def reduce(self, bucket: BucketRef, grad: torch.Tensor, comm: Collective) -> Pending:
        acc = self._residual(bucket.index, grad)
        acc.add_(grad)  # the residual tensor now holds a = residual + g
        k = topk_count(self.ratio, grad.numel())
        index_dtype = torch.int32 if grad.numel() <= _INT32_LIMIT else torch.int64
        mag, mask = self._scratch_for(acc)
        indices = top_indices(torch.abs(acc, out=mag), k, mask)
        values = acc.index_select(0, indices)
        acc.index_fill_(0, indices, 0.0)  # what was not sent stays in the residual
        where = f"bucket {bucket.index} at step {bucket.step}"
        # values and indices in one message (one allgather, not two: one latency per bucket):
        # the indices' bytes travel as they are, reinterpreted as the values' dtype and back
        message = _pack(values, indices.to(index_dtype))
        sent, gathered = comm.allgather(message, f"topk values and indices of {where}")
        world = comm.world_size

        def finish() -> None:
            grad.zero_()
            for got in gathered:  # rank order: the same sum on every rank
                val, idx = _unpack(got, k, index_dtype)
                grad.index_add_(0, idx.long(), val)
            if world > 1:
                grad.div_(world)

        return chain([sent], finish, f"topk reduction of {where}", comm)

    def _scratch_for(self, acc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(|a| buffer, mask buffer)`` of ``acc``'s size, dtype and device (grown, never
        shrunk: sized by the largest bucket after the first step)."""
        n = acc.numel()
        have = self._scratch
        if (
            have is None
            or have[0].numel() < n
            or have[0].dtype != acc.dtype
            or have[0].device != acc.device
        ):
            have = (
                torch.empty(n, dtype=acc.dtype, device=acc.device),
                torch.empty(n, dtype=torch.bool, device=acc.device),
            )
            self._scratch = have
        return have[0][:n].view_as(acc), have[1][:n].view_as(acc)

    def state_dict(self) -> dict[str, Any]:
        """The residual of every bucket."""
        return {"buckets": save_buckets(self._buckets)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._buckets = load_buckets(state.get("buckets", {}), "TopK")


def _pack(values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``values`` then the bytes of ``indices``, as one tensor of ``values``' dtype."""
    raw = indices.contiguous().view(torch.uint8)
    pad = (-raw.numel()) % values.element_size()
    if pad:
        raw = torch.cat([raw, raw.new_zeros(pad)])
    return torch.cat([values, raw.view(values.dtype)])


def _unpack(
    message: torch.Tensor, k: int, index_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`_pack`: ``(values, indices)`` of ``k`` entries each."""
    raw = message[k:].view(torch.uint8)
    return message[:k], raw[: k * index_dtype.itemsize].view(index_dtype)
