"""Half-width gradients on the wire: fp16 or bf16 payload, fp32 in and out.

GradientFlow (Sun et al. 2019) sends fp16 gradients to halve allreduce traffic. The bucket is
divided by the world size *in fp32* (so the sum of p values stays in range and the average is
not rounded twice), cast, summed by the collective in the half dtype, and cast back into the
fp32 bucket. The partial sums inside the collective are rounded to the half dtype at each hop
(as NCCL and gloo both do), so the result is within about ``(p-1)`` half-precision ulps of the
fp32 average.

bf16 on gloo: torch 2.13's gloo sums ``bfloat16`` (and ``float16``) CPU tensors natively
(checked by ``tests/dist/test_compression_dist.py``), so both formats take the same
allreduce path; no allgather fallback is needed.

Bytes on the wire per rank and bucket of ``n`` elements: ``2 * n``.
"""

from __future__ import annotations

from typing import Any

import torch

from syncline.comm.collectives import Collective, Pending
from syncline.dp.compression import BucketRef
from syncline.dp.compressors._pending import chain


class _HalfWidth:
    """Stateless cast-allreduce-cast; subclasses pick the wire dtype."""

    name = ""
    stateless = True  # no per-bucket state: the engine may re-cut its buckets
    wire_dtype = torch.float16

    def reduce(self, bucket: BucketRef, grad: torch.Tensor, comm: Collective) -> Pending:
        world = comm.world_size
        payload = (grad / world if world > 1 else grad).to(self.wire_dtype)
        what = f"{self.name} allreduce of bucket {bucket.index} at step {bucket.step}"
        sent = comm.allreduce(payload, what)

        def finish() -> None:
            grad.copy_(payload)

        return chain([sent], finish, what, comm)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class FP16(_HalfWidth):
    """IEEE half on the wire (5-bit exponent: the fp32 average must stay below 65504).

    Example:
        >>> dp = DataParallel(model, compression=FP16())
    """

    name = "fp16"
    wire_dtype = torch.float16


class BF16(_HalfWidth):
    """bfloat16 on the wire: fp32's range, 8 bits of mantissa (coarser than fp16).

    Example:
        >>> dp = DataParallel(model, compression=BF16())
    """

    name = "bf16"
    wire_dtype = torch.bfloat16
