"""Data-parallel replicas of pipeline stages: what the REDUCE action does (2BW's width ``w``).

PipeDream-2BW (Narayanan et al., ICML 2021, section 3) runs ``w`` copies of a ``d``-stage
pipeline, each on its own shard of every batch; before a stage's STEP its ``w`` replicas
average their gradients, so every replica applies the same update, the one a single pipeline
would apply to the whole batch. Each stage reduces with its own replicas only (its
data-parallel group, consecutive ranks on one node: :func:`syncline.comm.build_pipeline_groups`),
so the allreduces of different stages run at the same time, each overlapping the other
stages' compute.

How one REDUCE runs: the stage's accumulated gradients (under 2BW those of the weight version
the batch ran on, :meth:`~syncline.pipeline.stage.Stage.grad_holders`) are copied into one flat
buffer per stage, so one collective carries them instead of one per tensor (the lazy-allreduce
argument of GradientFlow, Sun et al. 2019); the buffer goes through the
:class:`~syncline.dp.compression.Compressor` (lossless, fp16, CSC, ...) on a
:class:`~syncline.comm.FlatAllreduce`, and each gradient becomes a view of the averaged buffer
(no copy back). The buffer is the compressor's bucket ``stage``, so stateful compressors (CSC
residuals, PowerSGD factors) keep one state per stage.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from syncline import comm
from syncline.dp.compression import BucketRef, Compressor, NoCompression
from syncline.errors import CommError, ConfigError

SIGNATURE = (
    "pipeline rank",
    "pipeline size",
    "num_stages",
    "num_microbatches",
    "schedule",
    "recompute",
    "trainable elements",
)


def check_groups(pipeline_group: comm.Group, data_parallel_group: comm.Group) -> int:
    """Validate the two groups of this rank before any communication; returns the replicas.

    The data-parallel group must contain this rank and meet the pipeline group only there (a
    replica of this stage runs in another pipeline).

    Raises:
        ConfigError: naming the groups' ranks.
    """
    me = comm.global_rank()
    if not comm.is_member(data_parallel_group):
        raise ConfigError(
            f"rank {me} is not a member of data_parallel_group; pass the group "
            "build_pipeline_groups returned on this rank"
        )
    dp, pipe = comm.group_ranks(data_parallel_group), comm.group_ranks(pipeline_group)
    shared = sorted(set(dp) & set(pipe))
    if shared != [me]:
        raise ConfigError(
            f"data_parallel_group ranks {dp} and the pipeline's process_group ranks {pipe} "
            f"share ranks {shared}; valid: they meet only in this rank {me} (each replica in "
            "another pipeline), e.g. the groups of build_pipeline_groups(num_stages)"
        )
    return len(dp)


def check_compression(compression: object) -> Compressor:
    if compression is None:
        return NoCompression()
    if not callable(getattr(compression, "reduce", None)) or not hasattr(compression, "name"):
        raise ConfigError(
            f"compression={compression!r} is not a syncline.dp.Compressor; valid: None, "
            "NoCompression(), FP16(), CSC(...), build_compressor('fp16'), ..."
        )
    return compression  # type: ignore[return-value]


class StageReplicas:
    """This rank's link to the replicas of its stages (see the module docstring).

    Args:
        group: the data-parallel group (size > 1).
        compression: reduces each stage's flat gradient.
        timeout_s: the longest any wait on a replica may take.
    """

    def __init__(self, group: comm.Group, compression: Compressor, timeout_s: float) -> None:
        self.group = group
        self.compression = compression
        self.ranks = comm.group_ranks(group)
        self._me = comm.global_rank()
        self._timeout_s = timeout_s
        self._comm = comm.FlatAllreduce(group, timeout_s=timeout_s)
        self._buffers: dict[int, torch.Tensor] = {}
        self.wire_bytes = 0  # what this rank's REDUCEs handed to the network, in all

    @property
    def size(self) -> int:
        return len(self.ranks)

    def _context(self, what: str) -> str:
        return f"rank {self._me}: {what} over data-parallel ranks {self.ranks}"

    def _wait(self, pending: comm.Pending, what: str) -> None:
        try:
            pending.wait()
        except CommError as exc:  # keep CommTimeout a CommTimeout
            raise type(exc)(f"{self._context(what)} failed: {exc}") from exc

    def _broadcast(self, tensors: Sequence[torch.Tensor], what: str) -> None:
        pending = comm.broadcast_tensors_async(
            tensors, src=0, group=self.group, what=what, timeout_s=self._timeout_s
        )
        self._wait(pending, what)

    def check_same(self, signature: Sequence[int]) -> None:
        """Every replica was built with the same pipeline shape (else the allreduces would
        pair up different tensors, or hang). All replicas gather all signatures, so all of
        them raise, not only the odd one out.

        Raises:
            ConfigError: naming each replica's values that differ from the first's.
        """
        what = "pipeline shape check"
        mine = torch.tensor(list(signature), dtype=torch.int64)
        pending, rows = self._comm.allgather(mine, what)
        self._wait(pending, what)
        first = rows[0].tolist()
        diff = [
            f"rank {rank}: {name}={a} (rank {self.ranks[0]}: {b})"
            for rank, row in zip(self.ranks, rows, strict=True)
            for name, a, b in zip(SIGNATURE, row.tolist(), first, strict=True)
            if a != b
        ]
        if diff:
            raise ConfigError(
                f"{self._context(what)}: the replicas were built differently: " + "; ".join(diff)
            )

    def join(self, parts: dict[int, nn.Module], shape: Sequence[int]) -> None:
        """Check that the replicas agree on the pipeline's ``shape`` (and the trainable
        parameter count of these stages), then copy the first replica's weights."""
        trainable = sum(
            p.numel() for part in parts.values() for p in part.parameters() if p.requires_grad
        )
        self.check_same([*shape, trainable])
        for s, part in parts.items():
            self.broadcast_weights(s, part)

    def agree(self, values: torch.Tensor, what: str) -> None:
        """Overwrite ``values`` with the first replica's (a profiled balance)."""
        self._broadcast([values], what)

    def broadcast_weights(self, stage: int, module: nn.Module) -> None:
        """Start every replica from the first replica's weights and buffers, as DDP does."""
        tensors = [*module.parameters(), *module.buffers()]
        self._broadcast(tensors, f"broadcast of stage {stage}'s weights")

    def _buffer(self, stage: int, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        numel = sum(t.numel() for t in tensors)
        flat = self._buffers.get(stage)
        if flat is None or flat.numel() != numel:
            dtypes = sorted({str(t.dtype) for t in tensors})
            if len(dtypes) > 1:
                raise ConfigError(
                    f"stage {stage} mixes parameter dtypes {dtypes}; data-parallel replicas "
                    "reduce one flat buffer per stage: use one dtype per stage"
                )
            flat = torch.empty(numel, dtype=tensors[0].dtype, device=tensors[0].device)
            self._buffers[stage] = flat
        return flat

    def reduce(self, stage: int, step: int, tensors: Sequence[torch.Tensor]) -> None:
        """Average the ``.grad`` of ``tensors`` (stage ``stage``, batch ``step``) over the
        replicas. A tensor without a gradient counts as zero and gets the average."""
        if not tensors:
            return
        flat = self._buffer(stage, tensors)
        views, layout, offset = [], [], 0
        with torch.no_grad():
            for t in tensors:
                view = flat[offset : offset + t.numel()].view_as(t)
                layout.append((offset, tuple(t.shape)))
                offset += t.numel()
                if t.grad is None:
                    view.zero_()
                else:
                    view.copy_(t.grad)
                views.append(view)
        what = f"REDUCE of stage {stage} at step {step}"
        try:
            bucket = BucketRef(stage, step, tuple(layout))  # per-tensor compressors (PowerSGD)
            pending = self.compression.reduce(bucket, flat, self._comm)
        except CommError as exc:
            raise type(exc)(f"{self._context(what)} failed: {exc}") from exc
        self._wait(pending, what)
        self.wire_bytes += pending.wire_bytes
        for t, view in zip(tensors, views, strict=True):
            t.grad = view

    def average_loss(self, value: torch.Tensor, step: int) -> None:
        """Replace this replica's batch loss by the mean over the replicas (in place)."""
        what = f"loss average of step {step}"
        self._wait(self._comm.allreduce(value, what), what)
        value.div_(self.size)
