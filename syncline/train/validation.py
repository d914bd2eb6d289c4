"""The validation loss during training: fixed held-out batches, every rank its shard.

Both training loops (data parallel, pipeline) evaluate through :class:`Validation`, so the
figure means the same whatever the layout: the mean loss of the same ``eval_batches`` global
batches of held-out samples (drawn once, with the run's seed, as training batches are drawn),
each rank (or each pipeline replica) its shard, averaged over the shards. A language
model's perplexity is ``exp`` of it (its loss is the mean cross-entropy per token).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from syncline import comm
from syncline.data import ShardedBatches
from syncline.pipeline.evaluate import evaluating
from syncline.train.config import TrainConfig

if TYPE_CHECKING:
    from syncline.pipeline import Pipeline

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

#: Offset of the validation batches' stream from the training batches' (same seed, another
#: stream), so the held-out draws do not repeat the training draws' pattern.
_STREAM = 1_000_003


class Validation:
    """When to validate and on what; :meth:`dp_loss` and :meth:`pipeline_loss` compute it.

    Args:
        cfg: the run's config (``eval_every``, ``eval_batches``, ``batch_size``, ``seed``).
        dataset: the held-out part, or ``None`` (then nothing is ever due).
        shard: this rank's shard of each batch (its data-parallel rank or replica).
        shards: the number of shards (data-parallel ranks or pipeline replicas).
        tokens_per_sample: > 1 for a language model (perplexity is reported).
    """

    def __init__(
        self, cfg: TrainConfig, dataset: Any | None, shard: int, shards: int, tokens_per_sample: int
    ) -> None:
        self._every = cfg.eval_every if dataset is not None else 0
        self._last = cfg.steps - 1
        self._timeout_s = cfg.timeout_s
        self.language_model = tokens_per_sample > 1
        self._batches: list[tuple[torch.Tensor, torch.Tensor]] = []
        if self._every:
            stream = ShardedBatches(dataset, cfg.batch_size, shard, shards, cfg.seed + _STREAM)
            self._batches = [stream.batch(i) for i in range(cfg.eval_batches)]

    def due(self, step: int) -> bool:
        """Whether step ``step`` (after its update) is validated: step 0, every
        ``eval_every``-th, and the last."""
        return bool(self._every) and (step % self._every == 0 or step == self._last)

    def metrics(self, loss: float) -> dict[str, float]:
        """``val_loss`` and, for a language model, ``val_ppl``."""
        out = {"val_loss": loss}
        if self.language_model:
            out["val_ppl"] = math.exp(min(loss, 700.0))  # exp overflows past ~709
        return out

    def dp_loss(self, module: nn.Module, loss_fn: LossFn, device: torch.device) -> float:
        """The data-parallel model's validation loss, the same on every rank.

        ``module`` is the wrapped model itself (``DataParallel.module``), run in ``eval()``
        mode without autograd, so no gradient hook fires and no buffer is synchronised.
        """
        total = torch.zeros(1, dtype=torch.float64)
        with evaluating([module]):
            for x, y in self._batches:
                out = module(x.to(device))
                total += loss_fn(out, y.to(device)).double().cpu()
        mean = total / len(self._batches)
        reduce = comm.FlatAllreduce(None, timeout_s=self._timeout_s)
        size = reduce.world_size
        if size > 1:
            shared = mean.to(device)
            reduce.allreduce(shared, "sum of the validation losses").wait()
            mean = shared.cpu() / size
        return float(mean.item())

    def pipeline_loss(self, pipe: Pipeline) -> float:
        """The pipeline's validation loss on every rank (its replicas averaged), forward only
        through the stages (:meth:`Pipeline.eval_step`), the weights as they are now."""
        losses = [pipe.eval_step(iter([batch])) for batch in self._batches]
        return sum(losses) / len(losses)
