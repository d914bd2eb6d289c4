"""Each stage boundary's message shape and dtype, inferred locally, without communication.

Why: under NCCL a receive is posted with its buffer inside a ``batch_isend_irecv`` group
(:mod:`syncline.comm.p2p`), so the receiver must know the shape when it issues the group; a
shape header would have to be read on the host first (a sync on every new shape, and a
buffer on the ``meta`` device cannot be read at all). torch.distributed.pipelining infers the
shapes instead, by running the stages' forwards on tensors without data; so does this module,
once per input signature (the shape and dtype of the micro-batch fed to stage 0), on every
rank, so every rank reaches the same answer with no message exchanged.

How: the stages run one after another under ``FakeTensorMode`` on the compute device, with
every parameter, buffer and tensor attribute replaced by a fake of its shape and dtype
(``torch.func.functional_call``). Meta tensors would do for shapes, but autocast ignores
them, and under bf16/fp16 a stage's output dtype is autocast's; fake tensors carry the
compute device, so autocast applies as in the real forward. The result depends only on the
model's structure and the signature, never on which stages this rank materialised, so every
rank infers alike. Nothing is allocated and no random number is drawn, and every module's
attributes are put back as they were afterwards: a forward that counts its calls or caches
a tensor in an attribute (rotary embeddings do) must not keep a fake one, nor count this.
Forward hooks do run (a hook may shape the output), once per signature, on fake tensors.

What cannot be inferred: a forward that reads values (``.item()``, ``if x.sum() > 0``, a
data-dependent shape such as ``nonzero``) raises under fake tensors; the shape is then
unknown (``None``) and the messages of that signature carry shape headers, as before
(:mod:`syncline.pipeline.links`). A traced model (``split_points``) has its boundaries fixed
by the trace instead (:func:`syncline.pipeline.traced_stage.boundary_likes`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager

import torch
from torch import nn

from syncline.pipeline.packets import Single

Like = tuple[tuple[int, ...], torch.dtype]
#: what a signature is keyed by: (shape, dtype) of stage 0's micro-batch input
Signature = tuple[tuple[int, ...], torch.dtype]
Autocast = Callable[[], AbstractContextManager[None]]


def _fake_state(module: nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
    """A fake of every parameter, buffer and plain tensor attribute of ``module``, by name
    (made inside a ``FakeTensorMode``), on ``device``."""
    named: dict[str, torch.Tensor] = dict(module.named_parameters())
    named.update(module.named_buffers())
    seen = {id(t) for t in named.values()}
    for prefix, sub in module.named_modules():
        for key, value in vars(sub).items():
            if isinstance(value, torch.Tensor) and id(value) not in seen:
                seen.add(id(value))
                named[f"{prefix}.{key}" if prefix else key] = value
    return {
        name: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
        for name, t in named.items()
    }


@contextmanager
def _attributes_kept(modules: Sequence[nn.Module]) -> Iterator[None]:
    """Every submodule's attributes as they were before the block (a shallow snapshot)."""
    saved = [(sub, dict(vars(sub))) for module in modules for sub in module.modules()]
    try:
        yield
    finally:
        for sub, attributes in saved:
            vars(sub).clear()
            vars(sub).update(attributes)


def infer_sequential(
    parts: Sequence[nn.Module],
    signature: Signature,
    device: torch.device,
    autocast: Autocast,
) -> list[Like] | None:
    """The message each stage of ``parts`` (one module each, one tensor in, one out) sends
    to the next for stage-0 inputs of ``signature``, or ``None`` if a forward reads values.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    rng = [device] if device.type == "cuda" else []
    likes: list[Like] = []
    try:
        with (
            _attributes_kept(parts),
            torch.random.fork_rng(devices=rng),
            torch.no_grad(),
            FakeTensorMode(),
        ):
            x = torch.empty(signature[0], dtype=signature[1], device=device)
            for s, part in enumerate(parts[:-1]):
                state = _fake_state(part, device)
                with autocast():
                    out = torch.func.functional_call(part, state, (x,), strict=False)
                message = Single().pack([out], s)
                likes.append((tuple(message.shape), message.dtype))
                x = message
    except Exception:  # a forward that reads values: the shape is not known without data
        return None
    return likes


class BoundaryShapes:
    """The inferred message of each boundary, per input signature, computed once each.

    Args:
        infer: ``infer(signature)``: per boundary ``s -> s+1`` its message, ``None`` where
            unknown, or ``None`` for all.
    """

    def __init__(self, infer: Callable[[Signature], Sequence[Like | None] | None]) -> None:
        self._infer = infer
        self._cache: dict[Signature, Sequence[Like | None] | None] = {}

    def like(self, edge: int, signature: Signature) -> Like | None:
        """What stage ``edge`` sends for micro-batch inputs of ``signature`` (``None``:
        cannot be inferred; headers carry it)."""
        if signature not in self._cache:
            self._cache[signature] = self._infer(signature)
        likes = self._cache[signature]
        return None if likes is None else likes[edge]
