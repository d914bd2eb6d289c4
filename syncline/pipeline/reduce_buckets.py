"""A stage's REDUCE in buckets, started during the batch's last backward of that stage.

A stage's gradient for a batch is final once its last micro-batch's backward has accumulated
into each tensor; from that moment the tensor can travel to the replicas, while autograd
still works through the stage's earlier layers. So the REDUCE is cut into buckets of about
``cap_bytes``, in the reverse of the stage's parameter order (the order backward finishes
them, as DDP's buckets are), and each bucket starts its collective as soon as all its tensors
are final in that backward (a ``post_accumulate_grad`` hook on each, installed only for that
one backward; :meth:`BucketedReduce.arm`); the REDUCE action then only starts the buckets
still due (tensors no backward reached count as zero, as before) and waits. Buckets start in
bucket order on every replica, which is all the data-parallel group needs for its collectives
to pair up, whatever moment each replica's backward reaches them.

Each bucket is the compressor's bucket ``k * num_stages + stage`` (``k`` the bucket number),
so a stateful compressor (CSC residuals, PowerSGD factors) keeps one state per bucket, and a
stage of one bucket keeps the index ``stage`` it always had.

Why the last micro-batch only: a tensor accumulates once per backward call (autograd sums a
tensor's uses inside one backward before accumulating), and each micro-batch's backward is
one call, so in the last one a tensor's hook fires at most once, with the batch's final sum.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from syncline.comm.collectives import Collective, Pending
from syncline.dp.compression import BucketRef, Compressor
from syncline.errors import ConfigError


def plan_buckets(numels: Sequence[int], element_size: int, cap_bytes: int) -> list[list[int]]:
    """Tensor indices per bucket: from the last tensor to the first, a new bucket whenever
    the next tensor would take the current one past ``cap_bytes`` (at least one tensor each;
    ``cap_bytes <= 0``: one bucket)."""
    buckets: list[list[int]] = []
    size = 0
    for i in reversed(range(len(numels))):
        nbytes = numels[i] * element_size
        if not buckets or (cap_bytes > 0 and size + nbytes > cap_bytes and buckets[-1]):
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += nbytes
    return buckets


@dataclass
class _Armed:
    """One batch's buckets of one stage, from the arming to the REDUCE."""

    batch: int
    tensors: list[torch.Tensor]
    remaining: list[int]  # per bucket: tensors not final yet
    next_bucket: int = 0
    pending: list[tuple[int, Pending]] = field(default_factory=list)
    hooks: list[Any] = field(default_factory=list)


class BucketedReduce:
    """The buckets of one stage on this rank (see the module docstring).

    Args:
        stage: the stage number.
        num_stages: the pipeline's depth (for the bucket indices).
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
        self._plan: list[list[int]] | None = None
        self._bucket_of: list[int] = []
        self._buffers: dict[int, torch.Tensor] = {}
        self._armed: _Armed | None = None
        #: what this stage's REDUCEs handed to the network, in all
        self.wire_bytes = 0
        #: buckets started from a backward hook (before the REDUCE action), in all
        self.early_buckets = 0

    @property
    def num_buckets(self) -> int:
        return 0 if self._plan is None else len(self._plan)

    def _planned(self, tensors: Sequence[torch.Tensor]) -> list[list[int]]:
        if self._plan is None or len(self._bucket_of) != len(tensors):
            dtypes = sorted({str(t.dtype) for t in tensors})
            if len(dtypes) > 1:
                raise ConfigError(
                    f"stage {self.stage} mixes parameter dtypes {dtypes}; data-parallel "
                    "replicas reduce flat buckets per stage: use one dtype per stage"
                )
            numels = [t.numel() for t in tensors]
            self._plan = plan_buckets(numels, tensors[0].element_size(), self._cap)
            self._bucket_of = [0] * len(tensors)
            for k, members in enumerate(self._plan):
                for i in members:
                    self._bucket_of[i] = k
            self._buffers.clear()
        return self._plan

    def arm(self, batch: int, tensors: Sequence[torch.Tensor]) -> None:
        """Start each bucket as the coming backward (``batch``'s last on this stage) makes
        its tensors final."""
        self.disarm()
        plan = self._planned(tensors)
        armed = _Armed(batch, list(tensors), [len(b) for b in plan])
        for i, t in enumerate(tensors):
            armed.hooks.append(t.register_post_accumulate_grad_hook(self._hook(armed, i)))
        self._armed = armed

    def _hook(self, armed: _Armed, i: int) -> Callable[[torch.Tensor], None]:
        def final(_tensor: torch.Tensor) -> None:
            if self._poll is not None:  # a phased collective (hierarchical) moves on
                self._poll()
            k = self._bucket_of[i]
            armed.remaining[k] -= 1
            while (
                armed.next_bucket < len(armed.remaining) and not armed.remaining[armed.next_bucket]
            ):
                self._launch(armed, armed.next_bucket)
                self.early_buckets += 1

        return final

    def disarm(self) -> None:
        """Remove the hooks (a backward that failed leaves them otherwise)."""
        if self._armed is not None:
            for h in self._armed.hooks:
                h.remove()
            self._armed.hooks.clear()

    def _launch(self, armed: _Armed, k: int) -> None:
        assert self._plan is not None
        members = self._plan[k]
        tensors = [armed.tensors[i] for i in members]
        numel = sum(t.numel() for t in tensors)
        flat = self._buffers.get(k)
        if flat is None:
            flat = torch.empty(numel, dtype=tensors[0].dtype, device=tensors[0].device)
            self._buffers[k] = flat
        layout, offset = [], 0
        views = []
        for t in tensors:
            views.append(flat[offset : offset + t.numel()].view_as(t))
            layout.append((offset, tuple(t.shape)))
            offset += t.numel()
        with torch.no_grad():  # one fused copy (and one zero) per bucket, not one per tensor
            pairs = zip(views, tensors, strict=True)
            filled = [(v, t.grad) for v, t in pairs if t.grad is not None]
            if filled:
                torch._foreach_copy_([v for v, _ in filled], [g for _, g in filled])
            empty = [v for v, t in zip(views, tensors, strict=True) if t.grad is None]
            if empty:
                torch._foreach_zero_(empty)
            if self._prepare is not None:
                self._prepare(armed.batch, flat)
        ref = BucketRef(k * self._d + self.stage, armed.batch, tuple(layout))
        armed.pending.append((k, self._compression.reduce(ref, flat, self._comm)))
        armed.next_bucket = k + 1

    def reduce(
        self, batch: int, tensors: Sequence[torch.Tensor], wait: Callable[..., None]
    ) -> None:
        """Average the ``.grad`` of ``tensors`` over the replicas: start the buckets not yet
        started (all of them when this batch was not armed), wait for each with ``wait(pending,
        what)`` and make each gradient a view of its averaged bucket."""
        armed = self._armed
        self.disarm()
        self._armed = None
        if armed is not None and (
            armed.batch != batch
            or len(armed.tensors) != len(tensors)
            or any(a is not b for a, b in zip(armed.tensors, tensors, strict=True))
        ):
            raise RuntimeError(
                f"stage {self.stage}: buckets armed for step {armed.batch}, REDUCE of step "
                f"{batch} (or of other tensors)"
            )
        if armed is None:
            plan = self._planned(tensors)
            armed = _Armed(batch, list(tensors), [len(b) for b in plan])
        assert self._plan is not None
        for k in range(armed.next_bucket, len(self._plan)):
            self._launch(armed, k)
        for k, pending in armed.pending:
            wait(pending, f"REDUCE of stage {self.stage} bucket {k} at step {batch}")
            self.wire_bytes += pending.wire_bytes
        with torch.no_grad():
            for k, members in enumerate(self._plan):
                flat, offset = self._buffers[k], 0
                for i in members:
                    t = armed.tensors[i]
                    t.grad = flat[offset : offset + t.numel()].view_as(t)
                    offset += t.numel()
