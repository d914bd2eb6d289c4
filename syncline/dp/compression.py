"""The gradient-compression strategy protocol and the lossless default.

A compressor turns one bucket of (locally averaged-to-be) gradients into traffic on a
:class:`~syncline.comm.Collective` and writes the averaged result back into the bucket. The
shape follows Horovod's and DDP's comm hooks (compress, communicate, decompress), with the
state (residuals, factors) held by the compressor so a checkpoint can save and restore it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from syncline.comm.collectives import Collective, Pending

#: ``(offset inside the bucket, shape)`` of each parameter of a bucket, in buffer order.
Layout = tuple[tuple[int, tuple[int, ...]], ...]


@dataclass(frozen=True)
class BucketRef:
    """Which bucket is being reduced, and when; compressors key their state on ``index``.

    ``layout`` says where each parameter's gradient lies inside the flat bucket and its shape,
    for compressors whose algorithm is defined per tensor (PowerSGD views each weight as a
    matrix). The engine always fills it in; it is empty when a caller reduces a bare buffer,
    and compressors that work on the flat buffer ignore it.
    """

    index: int
    step: int
    layout: Layout = ()


class Compressor(Protocol):
    """Reduce one bucket: on return of ``Pending.wait()``, ``grad`` holds the rank average.

    Attributes:
        name: the compressor's registry name (``syncline.dp.registry``).
        stateless: ``True`` when the compressor keeps no per-bucket state, so that the engine
            may re-cut the buckets (bucket autotuning); ``False`` keeps the first cut.

    On any device: every tensor a compressor hands to ``comm`` lives on ``grad``'s device (a
    CPU tensor fails under NCCL), and a steady-state ``reduce`` reads no value on the host
    (sizes come from shapes, decisions stay on the device), so a GPU step never stalls in
    it; state given to ``load_state_dict`` may be on the CPU (where a checkpoint is read) and
    moves to the gradient's device at its bucket's next reduction.
    ``tests/unit/test_compressors_meta.py`` holds every registered compressor to this.

    Optional, for a compressor whose second collective per bucket depends on its first (CSC,
    PowerSGD): a class attribute ``wants_lane = True`` asks the engine for a collective with a
    second process group (:attr:`syncline.comm.FlatAllreduce.lane`), and a ``poll()`` method,
    which the engine calls from every gradient hook, issues the second collectives whose first
    is done without blocking (:class:`~syncline.dp.compressors._pending.PhaseOrder`).

    Optional, for a compressor that owns the momentum (CSC): an ``absorb(index, grad)``
    method, which the engine calls with a bucket's *local* gradient of a step it reduced
    without the compressor (``DataParallel``'s lossless first step, a DDP hook's first
    backward), laid out as the compressor's bucket ``index`` is, so that the momentum receives
    every step's gradient.
    """

    name: str
    stateless: bool

    def reduce(self, bucket: BucketRef, grad: torch.Tensor, comm: Collective) -> Pending: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class NoCompression:
    """Full-precision allreduce: scale by 1/world size, then sum in place.

    Multiplying by the reciprocal, as DDP does, rather than dividing: a CPU divides several
    times slower than it multiplies, and for a
    power-of-two world size the result is bit-identical.
    """

    name = "none"
    stateless = True  # no per-bucket state: the engine may re-cut its buckets

    def reduce(self, bucket: BucketRef, grad: torch.Tensor, comm: Collective) -> Pending:
        if comm.world_size > 1:
            grad.mul_(1.0 / comm.world_size)
        return comm.allreduce(grad, f"allreduce of bucket {bucket.index} at step {bucket.step}")

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state
