"""A stage's REDUCE in buckets, started during the batch's last backward of that stage.

A stage's gradient for a batch is final once its last micro-batch's backward has accumulated
into each tensor; from that moment the tensor can travel to the replicas, while autograd
still works through the stage's earlier layers. So the REDUCE is cut into buckets of about
``cap_bytes``, in the reverse of the stage's parameter order (the order backward finishes
them, as DDP's buckets are), and each bucket starts its collective as soon as all its tensors
are final in that backward (a ``post_accumulate_grad`` hook on each, installed only for that
one backward; :meth:`BucketedReduce.arm`); the REDUCE action then only starts the buckets
still due (tensors no backward reached count as zero) and waits.

The buckets are ``DataParallel``'s: the same flat buffer and bucket plan
(:class:`~syncline.dp.layout.GradBuffer`, :func:`~syncline.dp.buckets.plan_buckets`) and
the same launch path (:class:`~syncline.dp.launches.BucketLaunches`: buckets start strictly
in order, each through the compressor). Each bucket is the compressor's bucket ``k *
num_stages + stage`` (``k`` the bucket number), so a stateful compressor (CSC residuals,
PowerSGD factors) keeps one state per bucket of every stage a rank holds.

Why the last micro-batch only: a tensor accumulates once per backward call (autograd sums a
tensor's uses inside one backward before accumulating), and each micro-batch's backward is
one call, so in the last one a tensor's hook fires at most once, with the batch's final sum.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from syncline.comm.collectives import Collective
from syncline.dp.compression import Compressor
from syncline.dp.launches import BucketLaunches
from syncline.dp.layout import GradBuffer


class BucketedReduce:
    """The buckets of one stage on this rank (see the module docstring).

    Args:
        stage: the stage number.
        num_stages: the pipeline's depth (for the bucket keys).
        cap_bytes: about how many bytes a bucket holds (``<= 0``: one bucket).
        compression: reduces each bucket.
        comm: the replicas' collective.
        prepare: called as ``prepare(batch, bucket)`` on each filled bucket before the
            compressor takes it (fp16 under an error-feedback compressor: the unscale).
    """

    def __init__(
        self, stage: int, num_stages: int, cap_bytes: int, compression: Compressor,
        comm: Collective, prepare: Callable[[int, torch.Tensor], None] | None = None,
    ) -> None:  # fmt: skip
        self.stage, self._d, self._cap = stage, num_stages, cap_bytes
        self._compression, self._comm, self._prepare = compression, comm, prepare
        self._poll: Callable[[], None] | None = getattr(comm, "poll", None)
        self._launches: BucketLaunches | None = None
        self._armed: int | None = None  # the batch whose last backward holds the hooks
        self._hooks: list[Any] = []
        #: what this stage's REDUCEs handed to the network, in all
        self.wire_bytes = 0
        #: buckets started from a backward hook (before the REDUCE action), in all
        self.early_buckets = 0

    @property
    def num_buckets(self) -> int:
        return 0 if self._launches is None else len(self._launches.buffer.plan.buckets)

    def _key(self, k: int) -> int:
        return k * self._d + self.stage

    def _for(self, tensors: Sequence[torch.Tensor]) -> BucketLaunches:
        """The launches over a buffer serving ``tensors`` (the buffer of the previous batch
        when they have its shapes: under 2BW, the other weight version's tensors)."""
        launches = self._launches
        if launches is None or not launches.buffer.rebind(list(tensors)):
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            cap = self._cap if self._cap > 0 else max(nbytes, 1)
            buffer = GradBuffer(list(tensors), (cap, cap), keep_spent=False)
            buffer.install(list(reversed(range(len(tensors)))))
            launches = BucketLaunches(
                buffer, self._comm, key=self._key, prepare=self._before, zero_missing=True
            )
            self._launches = launches
        return launches

    def _before(self, batch: int, k: int, bucket: torch.Tensor) -> None:
        del k
        if self._prepare is not None:
            self._prepare(batch, bucket)

    def arm(self, batch: int, tensors: Sequence[torch.Tensor]) -> None:
        """Start each bucket as the coming backward (``batch``'s last on this stage) makes
        its tensors final."""
        self.disarm()
        launches = self._for(tensors)
        launches.begin(batch, self._compression)
        self._hooks = [
            t.register_post_accumulate_grad_hook(self._hook(launches, i))
            for i, t in enumerate(launches.buffer.params)
        ]
        self._armed = batch

    def _hook(self, launches: BucketLaunches, i: int) -> Callable[[torch.Tensor], None]:
        def final(_tensor: torch.Tensor) -> None:
            if self._poll is not None:  # a phased collective (hierarchical) moves on
                self._poll()
            self.early_buckets += launches.final(i)

        return final

    def disarm(self) -> None:
        """Remove the hooks (a backward that failed leaves them otherwise)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def reduce(
        self, batch: int, tensors: Sequence[torch.Tensor], wait: Callable[..., None]
    ) -> None:
        """Average the ``.grad`` of ``tensors`` over the replicas: start the buckets not yet
        started (all of them when this batch was not armed), wait for each with ``wait(pending,
        what)``; each gradient is then a view of its averaged bucket."""
        armed, launches = self._armed, self._launches
        self.disarm()
        self._armed = None
        if (
            armed is not None
            and launches is not None
            and (
                armed != batch
                or len(launches.buffer.params) != len(tensors)
                or any(a is not b for a, b in zip(launches.buffer.params, tensors, strict=True))
            )
        ):
            raise RuntimeError(
                f"stage {self.stage}: buckets armed for step {armed}, REDUCE of step "
                f"{batch} (or of other tensors)"
            )
        if armed is None or launches is None:
            launches = self._for(tensors)
            launches.begin(batch, self._compression)
        launches.start_rest()
        for k, pending in enumerate(launches.pending):
            wait(pending, f"REDUCE of stage {self.stage} bucket {k} at step {batch}")
            self.wire_bytes += pending.wire_bytes
        launches.clear()
