"""The schedule zoo: the pipeline cases (schedule, optimizer, recompute, micro-batches, balance,
stages) that the multi-process pipeline tests run, and what each is checked against."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from syncline.models import lm_loss
from syncline.pipeline import Pipeline
from tests.zoo.models import OptimizerFactory, lm_reference, tiny_gpt

LR, MOMENTUM = 0.1, 0.9


def optimizer(kind: str) -> OptimizerFactory:
    """``"sgd"`` (lr 0.1, momentum 0.9) or ``"adam"`` (lr 0.01, eps 1e-5)."""
    if kind == "adam":
        # Adam divides by sqrt(v): with the default eps=1e-8 a gradient entry that is zero up
        # to fp32 rounding (summed in another order over micro-batches) becomes a full
        # +-lr step. eps=1e-5 keeps that rounding below the 1e-5 tolerance.
        return lambda ps: torch.optim.Adam(ps, lr=0.01, eps=1e-5)
    return lambda ps: torch.optim.SGD(ps, lr=LR, momentum=MOMENTUM)


@dataclass(frozen=True)
class PipeCase:
    """One pipeline configuration of ``tiny_gpt``, run on ``lm_batches``."""

    schedule: str
    microbatches: int
    balance: tuple[int, ...] | None  # None: profiled
    stages: int
    optimizer: str = "sgd"
    recompute: bool = False
    # posted in order, as for NCCL (which matches by order, not tag): no receive posted ahead
    in_order: bool = False
    # gradient compression of the data-parallel REDUCE (replicas only): "fp16", "powersgd"
    compression: str | None = None

    @property
    def stale(self) -> bool:
        """Whether the single-process reference follows 2BW's stale-weight rule."""
        return self.schedule == "2bw"

    def pipeline(self, **kwargs: Any) -> Pipeline:
        """A ``Pipeline`` of a fresh ``tiny_gpt`` for this case; ``kwargs`` add to it."""
        pipe = Pipeline(
            tiny_gpt(),
            num_stages=self.stages,
            num_microbatches=self.microbatches,
            schedule=self.schedule,
            loss_fn=lm_loss,
            optimizer=optimizer(self.optimizer),
            recompute=self.recompute,
            balance=None if self.balance is None else list(self.balance),
            **kwargs,
        )
        if self.in_order:
            pipe._ctx.links.early = False
        return pipe

    def reference(self) -> tuple[dict[str, torch.Tensor], list[float]]:
        """The single-process state and losses this case must reproduce."""
        return lm_reference(optimizer(self.optimizer), stale=self.stale)


# world size -> name -> case: one pipeline per process (test_pipeline_parity)
PARITY: dict[int, dict[str, PipeCase]] = {
    2: {
        "gpipe": PipeCase("gpipe", microbatches=4, balance=(2, 2), stages=2),
        "1f1b": PipeCase("1f1b", microbatches=4, balance=(2, 2), stages=2),
        "1f1b-recompute": PipeCase(
            "1f1b", microbatches=4, balance=(2, 2), stages=2, recompute=True
        ),
        "2bw-sgd": PipeCase("2bw", microbatches=4, balance=(1, 3), stages=2),
        "2bw-adam": PipeCase("2bw", microbatches=4, balance=(2, 2), stages=2, optimizer="adam"),
        "2bw-recompute": PipeCase("2bw", microbatches=2, balance=(2, 2), stages=2, recompute=True),
        "interleaved": PipeCase("interleaved", microbatches=4, balance=(1, 1, 1, 1), stages=4),
        "interleaved-recompute": PipeCase(
            "interleaved", microbatches=2, balance=(1, 1, 1, 1), stages=4, recompute=True
        ),
        "1f1b-profiled": PipeCase("1f1b", microbatches=2, balance=None, stages=2),
        "1f1b-in-order": PipeCase("1f1b", microbatches=4, balance=(2, 2), stages=2, in_order=True),
        "2bw-in-order": PipeCase(
            "2bw", microbatches=2, balance=(2, 2), stages=2, recompute=True, in_order=True
        ),
    },
    4: {
        "gpipe": PipeCase("gpipe", microbatches=8, balance=(1, 1, 1, 1), stages=4),
        "gpipe-recompute": PipeCase(
            "gpipe", microbatches=8, balance=(1, 1, 1, 1), stages=4, recompute=True
        ),
        "1f1b": PipeCase("1f1b", microbatches=8, balance=(1, 1, 1, 1), stages=4),
        "1f1b-recompute": PipeCase(
            "1f1b", microbatches=8, balance=(1, 1, 1, 1), stages=4, recompute=True
        ),
        "2bw-sgd": PipeCase("2bw", microbatches=8, balance=(1, 1, 1, 1), stages=4),
        "2bw-adam": PipeCase(
            "2bw", microbatches=4, balance=(1, 1, 1, 1), stages=4, optimizer="adam"
        ),
        "2bw-recompute": PipeCase(
            "2bw", microbatches=8, balance=(1, 1, 1, 1), stages=4, recompute=True
        ),
    },
}

# name -> case: 2 pipeline stages x 2 data-parallel replicas on 4 ranks (test_pipeline_replicas)
REPLICAS: dict[str, PipeCase] = {
    "gpipe": PipeCase("gpipe", microbatches=2, balance=(2, 2), stages=2),
    "1f1b": PipeCase("1f1b", microbatches=2, balance=(2, 2), stages=2),
    "2bw": PipeCase("2bw", microbatches=2, balance=(1, 3), stages=2),
    "2bw-fp16": PipeCase("2bw", microbatches=2, balance=(1, 3), stages=2, compression="fp16"),
    "1f1b-powersgd": PipeCase(
        "1f1b", microbatches=2, balance=(2, 2), stages=2, compression="powersgd"
    ),
    "interleaved": PipeCase("interleaved", microbatches=2, balance=(1, 1, 1, 1), stages=4),
    # each pipeline profiles: the first's wins
    "1f1b-profiled": PipeCase("1f1b", microbatches=2, balance=None, stages=2),
}
