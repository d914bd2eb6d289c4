"""The one path by which gradients leave a flat buffer: buckets started in order, as they fill.

Two callers reduce gradients in buckets, and both come here:

- :class:`syncline.dp.reducer.Reducer` (``DataParallel``): a hook on every parameter marks
  it final in each synchronised backward; the end of backward starts whatever is left;
- :class:`syncline.pipeline.reduce_buckets.BucketedReduce` (a pipeline stage's REDUCE over
  its replicas): the hooks are armed for the batch's last backward of that stage only, and
  the REDUCE action starts whatever is left.

Each counts a bucket's members as they become final (:meth:`BucketLaunches.final`); once a
bucket is complete, it and any complete buckets after it start, *strictly in bucket order*:
every rank then issues the same collectives in the same order whatever order its own
gradients arrive in, which is all a process group needs for its collectives to pair up.

Starting a bucket is the same for both: autograd's fresh gradients are copied into the
bucket's slice of the flat buffer in one batched copy
(:meth:`~syncline.dp.layout.GradBuffer.gather_bucket`), an optional ``prepare(step, k,
bucket)`` runs on it (fp16 beside an error-feedback compressor: the unscale), and the
compressor gets it as a :class:`~syncline.dp.compression.BucketRef` whose ``index`` keys the
compressor's state for that bucket (CSC residuals, PowerSGD factors): the bucket number
for ``DataParallel``, ``bucket * num_stages + stage`` for a pipeline (one compressor serves
every stage a rank holds, so each stage's buckets need keys of their own).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from syncline.comm.collectives import Collective, Pending
from syncline.dp.compression import BucketRef, Compressor
from syncline.dp.layout import GradBuffer

__all__ = ["BucketLaunches"]


class BucketLaunches:
    """One reduction at a time over ``buffer``'s buckets: what is final, started, in flight.

    Args:
        buffer: the flat buffer; its current plan is read at each :meth:`begin`, so a
            re-laid or re-cut buffer takes effect at the next reduction.
        collective: what every bucket's compressor talks through.
        key: the compressor's state key of bucket ``k`` (default: ``k``).
        prepare: called as ``prepare(step, k, bucket)`` on each filled bucket ``k`` before
            the compressor takes it.
        zero_missing: a member whose ``grad`` is ``None`` when its bucket starts counts as
            zero (a pipeline stage's tensor no backward reached); ``DataParallel`` settles
            such parameters itself before it starts their buckets.
    """

    def __init__(
        self,
        buffer: GradBuffer,
        collective: Collective,
        *,
        key: Callable[[int], int] | None = None,
        prepare: Callable[[int, int, torch.Tensor], None] | None = None,
        zero_missing: bool = False,
    ) -> None:
        self.buffer = buffer
        self.collective = collective
        self._key = key
        self.prepare = prepare
        self._zero_missing = zero_missing
        self._compressor: Compressor | None = None
        self.step = 0
        #: per bucket, members not final yet
        self.remaining: list[int] = []
        #: the next bucket to start (every bucket before it has started)
        self.next_bucket = 0
        #: the started buckets' collectives, in bucket order (then any the caller adds)
        self.pending: list[Pending] = []

    def begin(self, step: int, compressor: Compressor) -> None:
        """Start counting a new reduction of ``step``, whose buckets go through
        ``compressor``; forgets the previous one (wait for it first)."""
        self.step = step
        self._compressor = compressor
        self.remaining = [len(b.params) for b in self.buffer.plan.buckets]
        self.next_bucket = 0
        self.pending = []

    @property
    def started(self) -> bool:
        """Whether :meth:`begin` was called (and nothing has cleared it since)."""
        return self._compressor is not None

    def clear(self) -> None:
        """No reduction in progress."""
        self._compressor = None
        self.remaining = []
        self.next_bucket = 0
        self.pending = []

    def final(self, i: int) -> int:
        """Member ``i``'s gradient is final: start the buckets this completes.

        Returns:
            How many buckets started.
        """
        b = self.buffer.plan.bucket_of[i]
        self.remaining[b] -= 1
        if self.remaining[b]:  # buckets start in order: only a full one can start any
            return 0
        return self.start_complete()

    def start_complete(self) -> int:
        """Start the next buckets whose members are all final; how many started."""
        first, n = self.next_bucket, len(self.remaining)
        while self.next_bucket < n and self.remaining[self.next_bucket] == 0:
            self._start(self.next_bucket)
        return self.next_bucket - first

    def start_rest(self) -> None:
        """Start every bucket not started yet, final or not (the end of the reduction)."""
        for k in range(self.next_bucket, len(self.remaining)):
            self.remaining[k] = 0
        self.start_complete()

    def _start(self, k: int) -> None:
        assert self._compressor is not None, "begin() a reduction first"
        buf = self.buffer
        if self._zero_missing:
            buf.zero_missing(k)
        buf.gather_bucket(k)
        bucket = buf.bucket(k)
        if self.prepare is not None:
            self.prepare(self.step, k, bucket)
        key = k if self._key is None else self._key(k)
        ref = BucketRef(key, self.step, buf.layouts[k])
        self.pending.append(self._compressor.reduce(ref, bucket, self.collective))
        self.next_bucket = k + 1
