"""Weights shared across stages (a tied input embedding and output head), kept identical.

GPT-2 and Megatron's GPT use one matrix as the input embedding (stage 0) and the output
head (the last stage). Megatron keeps a copy on each of those stages and, before the
optimizer step, sums the copies' gradients between them (its "embedding group"), so both
copies take the same step and stay equal. The same is done here, at each stage's REDUCE
action, after the replicas have averaged it: every stage holding a copy sends its gradient
to every other holder and receives theirs, and each adds them up **in stage order**, so the
sums, and with them the copies, are bit-identical on every holder (floating-point addition
in one order). Under 2BW the gradients are those of the weight version the batch ran on,
the same version on every stage.

The copies start equal (the trace copies one tensor) and every holder applies the same
optimizer to the same gradient, so they stay equal (``tests/dist/test_pipeline_traced.py``
compares them bit for bit). Holders of one group on one rank (an interleaved schedule) are
refused when the pipeline is built.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from syncline.comm.p2p import Op, PointToPoint
from syncline.errors import ConfigError

#: ``tag(group, batch, sending stage)``
Tag = Callable[[int, int, int], int]


class TiedGradients:
    """The gradient sums of this rank's tied copies.

    Args:
        p2p: the point-to-point layer over the pipeline's group.
        groups: per tied parameter, ``{stage: its name in that stage's module}``.
        rank_of: the rank that runs a stage.
        tag: ``tag(group, batch, sending stage)``, unique among messages in flight.
    """

    def __init__(
        self,
        p2p: PointToPoint,
        groups: Sequence[Mapping[int, str]],
        rank_of: Callable[[int], int],
        tag: Tag,
    ) -> None:
        for group in groups:
            ranks = [rank_of(s) for s in group]
            if len(set(ranks)) != len(ranks):
                raise ConfigError(
                    f"the tied weight {dict(group)} has copies on stages {sorted(group)} that "
                    f"run on one rank ({ranks}); valid: tied copies on stages of different "
                    "ranks (a non-interleaved schedule)"
                )
        self._p2p = p2p
        self._groups = [dict(g) for g in groups]
        self._rank_of = rank_of
        self._tag = tag

    def groups_of(self, stage: int) -> list[int]:
        return [k for k, g in enumerate(self._groups) if stage in g]

    def sum(self, stage: int, batch: int, holders: Mapping[str, torch.Tensor]) -> None:
        """Replace the ``.grad`` of ``stage``'s tied copies (in ``holders``, by name) by the
        sum over all copies of batch ``batch``'s gradients; blocks until the others' come.
        Each tied group's sends and receives go out as one group (:meth:`PointToPoint.batch`,
        which NCCL launches together, so no holder's send waits behind another's)."""
        for k in self.groups_of(stage):
            group = self._groups[k]
            mine = holders[group[stage]]
            grad = torch.zeros_like(mine) if mine.grad is None else mine.grad
            payload = grad.detach().contiguous()
            parts = {stage: grad}
            ops = []
            for other in sorted(group):
                if other == stage:
                    continue
                peer = self._rank_of(other)
                parts[other] = torch.empty_like(payload)
                ops.append(Op(True, payload, peer, self._tag(k, batch, stage)))
                ops.append(Op(False, parts[other], peer, self._tag(k, batch, other)))
            what = f"tied gradient {group[stage]!r} of step {batch} with stages {sorted(group)}"
            self._p2p.batch(ops, what).wait()
            total = parts[min(parts)].clone()
            for s in sorted(parts)[1:]:
                total += parts[s]
            mine.grad = total
