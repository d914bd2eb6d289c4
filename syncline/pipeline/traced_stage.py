"""A traced model's stages as pipeline stages: what each receives, computes and hands on.

:func:`~syncline.pipeline.trace.trace_model` gives stage graphs whose inputs come from the
model's inputs or from *any* earlier stage (GPT-2's attention mask, made by stage 0, is read
by every later stage). A pipeline only links neighbours, so here each boundary ``s -> s+1``
carries every value that a stage after ``s`` needs from a stage up to ``s``: the values a
stage computes, and those it passes through unchanged. Model inputs are not sent: every rank
takes every batch, so each stage reads them from its own micro-batch.

A :class:`TracedStage` is an ``nn.Module`` (its parameters keep the model's names under
``stage.``), so weight versions, recomputation, replicas and checkpoints treat it like any
stage; its forward maps the received values and the micro-batch's inputs to the values it
hands on (the last stage: the model's output). A value passed through is the received leaf
itself, so its gradient from later stages adds to the gradient sent back, as it must.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import fx, nn

from syncline.pipeline.packets import Codec, Like, Packed, Single
from syncline.pipeline.trace import Source, TracedModel

#: a value in flight: (stage that made it, index in its outputs or None)
Value = tuple[int, int | None]


class TracedStage(nn.Module):
    """One stage of a traced model (see the module docstring).

    Args:
        stage: the stage's graph module.
        sources: where each of its inputs comes from, in its parameters' order.
        received: the values arriving from the previous stage, in message order.
        sent: the values handed to the next stage (the last stage: ``[output]``).
        index: the stage number.
        in_codec, out_codec: how the received and the sent values travel (``None``: the
            first stage receives nothing, the last sends nothing).
    """

    def __init__(
        self,
        stage: nn.Module,
        sources: Sequence[Source],
        received: Sequence[Value],
        sent: Sequence[Value],
        index: int,
        in_codec: Codec | None,
        out_codec: Codec | None,
    ) -> None:
        super().__init__()
        self.stage = stage
        self.index = index
        self.in_codec, self.out_codec = in_codec, out_codec
        self._sources = list(sources)
        self._position = {v: i for i, v in enumerate(received)}
        self._sent = list(sent)

    def forward(
        self, received: Sequence[torch.Tensor], inputs: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, ...]:
        # by position, in placeholder order: a generated forward may name a parameter other
        # than its placeholder (a model input called ``input``, a builtin's name, becomes
        # the placeholder ``input_1`` and the parameter ``input``)
        args = [
            inputs[source.name]
            if source.stage is None
            else received[self._position[(source.stage, source.index)]]
            for source in self._sources
        ]
        out = self.stage(*args)
        values = []
        for made_by, index in self._sent:
            if made_by == self.index:
                values.append(out if index is None else out[index])
            else:
                values.append(received[self._position[(made_by, index)]])
        return tuple(values)


def carried(traced: TracedModel) -> list[list[Value]]:
    """Per boundary ``s -> s+1``: the values a later stage needs from stages up to ``s``, in
    order of first need (the last entry: the model output's source, as one list)."""
    d = len(traced.stages)
    out: list[list[Value]] = []
    for s in range(d - 1):
        values: list[Value] = []
        for later in range(s + 1, d):
            for source in traced.sources[later]:
                value = (source.stage, source.index)
                if source.stage is not None and source.stage <= s and value not in values:
                    values.append((source.stage, source.index))
        out.append(values)
    return out


def _likes(traced: TracedModel) -> dict[Value, Like]:
    """Shape and dtype of every value a stage reads from another, from the traced graphs."""
    likes: dict[Value, Like] = {}
    for stage, sources in zip(traced.stages, traced.sources, strict=True):
        graph = stage.graph if isinstance(stage, fx.GraphModule) else None
        nodes = [n for n in graph.nodes if n.op == "placeholder"] if graph is not None else []
        for node, source in zip(nodes, sources, strict=True):
            if source.stage is not None:
                val: Any = node.meta["val"]
                likes[(source.stage, source.index)] = (tuple(val.shape), val.dtype)
    return likes


def codec_of(likes: Sequence[Like]) -> Codec:
    """One floating value travels as it is; anything else packed."""
    if len(likes) == 1 and likes[0][1].is_floating_point:
        return Single()
    return Packed(tuple(likes))


def traced_stages(traced: TracedModel, stages: Sequence[int]) -> dict[int, TracedStage]:
    """The :class:`TracedStage` of each of ``stages`` of ``traced``."""
    d = len(traced.stages)
    boundaries = carried(traced)
    likes = _likes(traced)
    out = {}
    for s in stages:
        received = boundaries[s - 1] if s else []
        sent = boundaries[s] if s < d - 1 else [(traced.output.stage or 0, traced.output.index)]
        out[s] = TracedStage(
            traced.stages[s], traced.sources[s], received, sent, s,
            in_codec=codec_of([likes[v] for v in received]) if s else None,
            out_codec=codec_of([likes[v] for v in sent]) if s < d - 1 else None,
        )  # fmt: skip
    return out


def boundary_likes(traced: TracedModel, precision: str) -> list[Like | None]:
    """Per boundary ``s -> s+1`` of ``traced``, the message that crosses it, known without
    running anything (:mod:`syncline.pipeline.shapes`): a packet's layout is fixed by the
    trace; so is a single floating value, unless autocast may change its dtype (the trace
    ran without it): ``None``, unknown, and such messages carry shape headers."""
    likes = _likes(traced)
    out: list[Like | None] = []
    for values in carried(traced):
        codec = codec_of([likes[v] for v in values])
        if isinstance(codec, Packed):
            out.append(((codec.nbytes,), torch.uint8))
        else:
            out.append(likes[values[0]] if precision == "fp32" else None)
    return out
