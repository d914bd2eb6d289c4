"""Data-parallel replicas of pipeline stages: what the REDUCE action does (2BW's width ``w``).

PipeDream-2BW (Narayanan et al., ICML 2021, section 3) runs ``w`` copies of a ``d``-stage
pipeline, each on its own shard of every batch; before a stage's STEP its ``w`` replicas
average their gradients, so every replica applies the same update, the one a single pipeline
would apply to the whole batch. Each stage reduces with its own replicas only (its
data-parallel group, consecutive ranks on one node: :func:`syncline.comm.build_pipeline_groups`),
so the allreduces of different stages run at the same time, each overlapping the other
stages' compute.

How one REDUCE runs: the stage's accumulated gradients (under 2BW those of the weight version
the batch ran on, :meth:`~syncline.pipeline.stage.Stage.grad_holders`) are copied into a few
flat buckets, so few collectives carry them instead of one per tensor (the lazy-allreduce
argument of GradientFlow, Sun et al. 2019), and each bucket starts as soon as the stage's
last backward of the batch has made its gradients final, overlapping the rest of that
backward (:mod:`syncline.pipeline.reduce_buckets`). Each bucket goes through the
:class:`~syncline.dp.compression.Compressor` (lossless, fp16, CSC, ...) on a
:class:`~syncline.comm.FlatAllreduce`, and each gradient becomes a view of its averaged
bucket (no copy back). Stateful compressors (CSC residuals, PowerSGD factors) keep one state
per bucket.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from syncline import comm
from syncline.comm.device import comm_device
from syncline.dp.compression import Compressor, NoCompression
from syncline.errors import CommError, ConfigError
from syncline.pipeline.reduce_buckets import BucketedReduce

#: a REDUCE bucket's size when none is given: big enough that a collective's fixed cost is
#: small against its transfer, small enough that several start during the last backward
DEFAULT_BUCKET_CAP_MB = 4.0

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
        compression: reduces each bucket of a stage's gradient.
        timeout_s: the longest any wait on a replica may take.
        num_stages: the pipeline's depth (numbers the compressor's buckets).
        bucket_cap_mb: about how much of a stage's gradient one bucket holds (``0``: one
            bucket per stage).
        allreduce: the REDUCE's collective over ``group`` (e.g. a hierarchical one, for
            replicas on several nodes); default: a flat ring.
        prepare: called as ``prepare(batch, bucket)`` on each bucket before the compressor
            takes it (fp16 beside an error-feedback compressor: the unscale,
            :meth:`syncline.pipeline.precision.PipelinePrecision.unscale_bucket`).
        device: where the stages compute; the setup's messages go on the group's
            communication device for it (:func:`syncline.comm.device.comm_device`).
    """

    def __init__(
        self,
        group: comm.Group,
        compression: Compressor,
        timeout_s: float,
        *,
        num_stages: int = 1,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        allreduce: comm.Collective | None = None,
        prepare: Callable[[int, torch.Tensor], None] | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.group = group
        compute = torch.device("cpu") if device is None else device
        self._wire = comm_device(comm.backend_name(group), compute)
        self._prepare = prepare
        self.compression = compression
        self.ranks = comm.group_ranks(group)
        self._me = comm.global_rank()
        self._timeout_s = timeout_s
        self._comm = comm.FlatAllreduce(group, timeout_s=timeout_s)
        #: the REDUCE's collective (the loss average and the checks keep the flat ring)
        self._reduce_comm = allreduce if allreduce is not None else self._comm
        self._num_stages = num_stages
        self._cap_bytes = int(bucket_cap_mb * 2**20)
        self._reducers: dict[int, BucketedReduce] = {}

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
        mine = torch.tensor(list(signature), dtype=torch.int64, device=self._wire)
        pending, rows = self._comm.allgather(mine, what)
        self._wait(pending, what)
        if mine.is_meta:  # a stand-in device in tests (fake backend): no values to compare
            return
        table = torch.stack(rows).tolist()  # read on the host once, at setup
        first = table[0]
        diff = [
            f"rank {rank}: {name}={a} (rank {self.ranks[0]}: {b})"
            for rank, row in zip(self.ranks, table, strict=True)
            for name, a, b in zip(SIGNATURE, row, first, strict=True)
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
        """Overwrite ``values`` with the first replica's (a profiled balance); ``values``
        on the group's communication device."""
        self._broadcast([values], what)

    def broadcast_weights(self, stage: int, module: nn.Module) -> None:
        """Start every replica from the first replica's weights and buffers, as DDP does
        (they travel from where they are when that is the communication device; else through
        a copy there, written back)."""
        tensors = [*module.parameters(), *module.buffers()]
        moved = [t if t.device == self._wire else t.detach().to(self._wire) for t in tensors]
        self._broadcast(moved, f"broadcast of stage {stage}'s weights")
        with torch.no_grad():
            for t, m in zip(tensors, moved, strict=True):
                if m is not t:
                    t.copy_(m)

    def _buckets(self, stage: int) -> BucketedReduce:
        reducer = self._reducers.get(stage)
        if reducer is None:
            reducer = BucketedReduce(
                stage, self._num_stages, self._cap_bytes, self.compression, self._reduce_comm,
                self._prepare,
            )  # fmt: skip
            self._reducers[stage] = reducer
        return reducer

    @property
    def wire_bytes(self) -> int:
        """What this rank's REDUCEs handed to the network, in all."""
        return sum(r.wire_bytes for r in self._reducers.values())

    @property
    def early_buckets(self) -> int:
        """Buckets started during a backward, before their REDUCE action, in all."""
        return sum(r.early_buckets for r in self._reducers.values())

    def arm(self, stage: int, step: int, tensors: Sequence[torch.Tensor]) -> None:
        """The coming backward is stage ``stage``'s last of batch ``step``: start each bucket
        of its REDUCE as the backward makes its gradients final
        (:mod:`syncline.pipeline.reduce_buckets`)."""
        if tensors:
            self._buckets(stage).arm(step, tensors)

    def disarm(self) -> None:
        """Remove any hooks an interrupted backward left."""
        for r in self._reducers.values():
            r.disarm()

    def reduce(self, stage: int, step: int, tensors: Sequence[torch.Tensor]) -> None:
        """Average the ``.grad`` of ``tensors`` (stage ``stage``, batch ``step``) over the
        replicas. A tensor without a gradient counts as zero and gets the average."""
        if not tensors:
            return
        what = f"REDUCE of stage {stage} at step {step}"
        try:
            self._buckets(stage).reduce(step, tensors, self._wait)
        except CommError as exc:
            raise type(exc)(f"{self._context(what)} failed: {exc}") from exc

    def average_loss(self, value: torch.Tensor, step: int) -> None:
        """Replace this replica's batch loss by the mean over the replicas (in place)."""
        what = f"loss average of step {step}"
        self._wait(self._comm.allreduce(value, what), what)
        value.div_(self.size)
