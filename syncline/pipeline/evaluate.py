"""Forward-only passes through the stages: a validation loss, or the model's outputs.

Evaluation needs none of training's machinery: no weight versions (the stages' Parameters
hold the newest weights, under 2BW too, so nothing is touched and no batch in flight is
disturbed), no activations kept for a backward, no schedule. Each rank runs its stages in
increasing order; for each stage the micro-batches go through in order, each received from
the previous stage's rank, run under ``torch.no_grad()`` and sent on asynchronously. Data
only flows forward, so this cannot deadlock, and micro-batch ``i`` of a stage overlaps with
micro-batch ``i+1`` of the stage before it (GPipe's forward half).

The messages carry their shape header (evaluation batches may have any shape) and use tags
above every tag a training call uses, so an evaluation between two 2BW calls, while the
next batch's activations are on their way, cannot take one of them.

Under NCCL (``in_lockstep``), which pairs messages in issue order and makes a large send wait
for its receive, a rank that holds several stages (interleaved) takes the micro-batches one
at a time through all of its stages instead: otherwise its first stage's sends of every
micro-batch would queue ahead of the receive its later stage needs, while the next rank's
send of that very message waits for a receive queued behind them.

The stage modules are put in ``eval()`` mode for the pass (dropout off, BatchNorm on its
running statistics, as a validation pass expects) and back in their mode afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from syncline.comm.collectives import Pending
from syncline.comm.p2p import PointToPoint
from syncline.pipeline.batches import Inputs, to_device
from syncline.pipeline.links import max_tag
from syncline.pipeline.replicas import StageReplicas
from syncline.pipeline.stage import Stage
from syncline.schedule import Schedule

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@contextmanager
def evaluating(modules: Sequence[nn.Module]) -> Iterator[None]:
    """``eval()`` mode and no autograd for the block; each module's mode restored after."""
    modes = [[m.training for m in module.modules()] for module in modules]
    for module in modules:
        module.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for module, saved in zip(modules, modes, strict=True):
            for m, training in zip(module.modules(), saved, strict=True):
                m.training = training


class ForwardOnly:
    """One forward-only pass through this rank's stages (see the module docstring).

    Args:
        p2p: the point-to-point layer over the pipeline's group.
        schedule: the training schedule, for the rank of each stage.
        stages: this rank's stages by stage number.
        num_microbatches: m, for the tags (a pass takes at most m micro-batches).
        device: where the stages run.
        step: the pass's number (its tags, and errors).
        loss_fn: the training loss, for :meth:`loss`.
        replicas: the stage's replicas, whose losses :meth:`loss` averages.
        in_lockstep: micro-batch by micro-batch through this rank's stages (NCCL; see the
            module docstring), instead of stage by stage.
    """

    def __init__(
        self,
        p2p: PointToPoint,
        schedule: Schedule,
        stages: Mapping[int, Stage],
        num_microbatches: int,
        device: torch.device,
        step: int,
        loss_fn: LossFn,
        replicas: StageReplicas | None,
        in_lockstep: bool = False,
    ) -> None:
        self._p2p, self._schedule, self._stages = p2p, schedule, stages
        self._d, self._m = schedule.num_stages, num_microbatches
        self._device, self._step = device, step
        self._loss_fn, self._replicas = loss_fn, replicas
        self._base = max_tag(self._d, num_microbatches) + 1
        self._last_rank = schedule.rank_of(self._d - 1)
        self._lockstep = in_lockstep

    def tag(self, edge: int, microbatch: int) -> int:
        """The tag of stage ``edge``'s output for ``microbatch`` (``edge = d``: the result);
        passes alternate over four tag sets, as training's batches do."""
        return self._base + ((self._step % 4) * (self._d + 1) + edge) * self._m + microbatch

    def loss(self, inputs: Sequence[Inputs], targets: Sequence[torch.Tensor]) -> float:
        """The batch's mean loss on every rank (micro-batches of equal size)."""
        outputs = self._run(inputs)
        value = None
        if outputs:  # the last stage: the mean of the micro-batches' means
            with torch.no_grad():
                losses = [
                    self._loss_fn(out, y.to(self._device)).double()
                    for out, y in zip(outputs, targets, strict=True)
                ]
            value = torch.stack(losses).mean().reshape(1)
            if self._replicas is not None:
                self._replicas.average_loss(value, self._step)
        return float(self._share(value).item())

    def outputs(self, inputs: Sequence[Inputs]) -> torch.Tensor:
        """The last stage's outputs, concatenated, on every rank."""
        outputs = self._run(inputs)
        return self._share(torch.cat(outputs) if outputs else None)

    def _run(self, inputs: Sequence[Inputs]) -> list[torch.Tensor]:
        """The last stage's outputs of ``inputs`` on the last stage's rank, else ``[]``."""
        if len(inputs) > self._m:
            raise ValueError(f"{len(inputs)} micro-batches, more than m={self._m}")
        sends: list[Pending] = []
        outputs: list[torch.Tensor] = []
        order = [(s, mb) for s in sorted(self._stages) for mb in range(len(inputs))]
        if self._lockstep:
            order.sort(key=lambda pair: (pair[1], pair[0]))
        with evaluating([stage.module for stage in self._stages.values()]):
            for s, mb in order:
                stage, part = self._stages[s], inputs[mb]
                where = f"stage {s}, mb {mb} of evaluation pass {self._step}"
                local = to_device(part, self._device) if stage.traced or s == 0 else None
                if s == 0:
                    x = None if stage.traced else local
                else:
                    src = self._schedule.rank_of(s - 1)
                    x = self._p2p.recv(src, tag=self.tag(s - 1, mb), what=f"input of {where}")
                out = stage.infer(x, local if stage.traced else None)  # type: ignore[arg-type]
                if s == self._d - 1:
                    outputs.append(out)
                    continue
                dst = self._schedule.rank_of(s + 1)
                tag = self.tag(s, mb)
                sends.append(self._p2p.send(out, dst, tag=tag, what=f"output of {where}"))
        for pending in sends:
            pending.wait()
        return outputs

    def _share(self, value: torch.Tensor | None) -> torch.Tensor:
        """``value`` (given on the last stage's rank) on every rank of the pipeline."""
        src, tag = self._last_rank, self.tag(self._d, 0)
        what = f"result of evaluation pass {self._step}"
        if self._p2p.rank != src:
            return self._p2p.recv(src, tag=tag, what=f"{what} from rank {src}")
        assert value is not None
        ranks = [r for r in range(self._schedule.num_ranks) if r != src]
        sends = [self._p2p.send(value, r, tag=tag, what=f"{what} to rank {r}") for r in ranks]
        for pending in sends:
            pending.wait()
        return value
