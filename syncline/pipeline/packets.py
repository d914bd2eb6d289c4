"""What crosses a stage boundary: one tensor, or several of any dtype packed into one message.

An ``nn.Sequential`` stage hands one floating-point tensor to the next; it travels as it is
(:class:`Single`, no copy). A stage of a traced model (:mod:`syncline.pipeline.trace`) may
hand on several values, floating or not (GPT-2: the hidden state and a boolean attention
mask), some only passing through on their way to a later stage. :class:`Packed` sends them
as one message, so the runtime, the message tags and the early receives stay those of one
tensor per edge and micro-batch:

- forward: the values' bytes side by side in one ``uint8`` buffer (one copy), each segment
  aligned to 8 bytes so that the receiver reads every value as a view of its dtype;
- backward: only the floating-point values carry a gradient; their gradients go back the
  same way, in a second layout of those values alone (no bytes spent on the mask).

The layout is static: a traced stage's boundary values have the shapes of the traced
micro-batch (the trace refuses any other), so both sides know it without a header.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

Like = tuple[tuple[int, ...], torch.dtype]
_ALIGN = 8


def _nbytes(like: Like) -> int:
    numel = 1
    for n in like[0]:
        numel *= n
    return numel * like[1].itemsize


def _padded(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class Single:
    """One floating-point tensor per message, sent as it is (``nn.Sequential`` stages)."""

    def pack(self, values: Sequence[torch.Tensor], stage: int) -> torch.Tensor:
        (out,) = values
        if not isinstance(out, torch.Tensor):
            raise TypeError(
                f"stage {stage} returned {type(out).__name__}; every stage must map one "
                "tensor to one tensor"
            )
        if not out.is_floating_point():
            raise TypeError(
                f"stage {stage} output has dtype {out.dtype}; activations passed "
                "between stages must be floating point (they carry gradients back)"
            )
        return out.detach()

    def unpack(self, message: torch.Tensor) -> list[torch.Tensor]:
        """The received value as a leaf that collects its gradient (if it can have one)."""
        if message.is_floating_point():
            return [message.detach().requires_grad_()]
        return [message]

    def grad_like(self, message: torch.Tensor) -> Like:
        return tuple(message.shape), message.dtype

    def pack_grads(self, leaves: Sequence[torch.Tensor]) -> torch.Tensor:
        (leaf,) = leaves
        return torch.zeros_like(leaf) if leaf.grad is None else leaf.grad

    def unpack_grads(self, message: torch.Tensor) -> list[torch.Tensor]:
        return [message]


@dataclass(frozen=True)
class Packed:
    """Several values of fixed shapes and dtypes in one ``uint8`` message (module docstring).

    Attributes:
        likes: each value's ``(shape, dtype)``, in message order.
    """

    likes: tuple[Like, ...]

    @property
    def nbytes(self) -> int:
        """The message's size: the ``uint8`` buffer :meth:`pack` makes."""
        return self._offsets(self.likes)[-1]

    @property
    def floating(self) -> list[int]:
        """Positions of the values that carry a gradient."""
        return [i for i, (_, dtype) in enumerate(self.likes) if dtype.is_floating_point]

    @staticmethod
    def _offsets(likes: Sequence[Like]) -> list[int]:
        out, at = [], 0
        for like in likes:
            out.append(at)
            at += _padded(_nbytes(like))
        return [*out, at]

    @staticmethod
    def _join(
        values: Sequence[torch.Tensor], likes: Sequence[Like], device: torch.device
    ) -> torch.Tensor:
        offsets = Packed._offsets(likes)
        buffer = torch.empty(offsets[-1], dtype=torch.uint8, device=device)
        for value, at in zip(values, offsets, strict=False):
            data = value.detach().contiguous().reshape(-1).view(torch.uint8)
            buffer[at : at + data.numel()].copy_(data)
        return buffer

    @staticmethod
    def _split(message: torch.Tensor, likes: Sequence[Like]) -> list[torch.Tensor]:
        offsets = Packed._offsets(likes)
        if message.dtype != torch.uint8 or message.numel() != offsets[-1]:
            raise RuntimeError(
                f"received {message.numel()} {message.dtype} for a packet of {offsets[-1]} "
                f"bytes holding {[(list(s), str(d)) for s, d in likes]}"
            )
        return [
            message[at : at + _nbytes(like)].view(like[1]).view(like[0])
            for like, at in zip(likes, offsets, strict=False)
        ]

    def check(self, values: Sequence[torch.Tensor], stage: int) -> None:
        got = tuple((tuple(v.shape), v.dtype) for v in values)
        if got != self.likes:
            raise RuntimeError(
                f"stage {stage} hands on {[(list(s), str(d)) for s, d in got]}, but its "
                f"traced boundary is {[(list(s), str(d)) for s, d in self.likes]}"
            )

    def pack(self, values: Sequence[torch.Tensor], stage: int) -> torch.Tensor:
        self.check(values, stage)
        return self._join(values, self.likes, values[0].device)

    def unpack(self, message: torch.Tensor) -> list[torch.Tensor]:
        """The values, as views of ``message``; the floating ones as leaves that collect
        their gradient."""
        values = self._split(message, self.likes)
        return [v.detach().requires_grad_() if v.is_floating_point() else v for v in values]

    def grad_like(self, message: torch.Tensor) -> Like:
        del message
        return (self._offsets([self.likes[i] for i in self.floating])[-1],), torch.uint8

    def pack_grads(self, leaves: Sequence[torch.Tensor]) -> torch.Tensor:
        grads = []
        for i in self.floating:
            grad = leaves[i].grad
            grads.append(torch.zeros_like(leaves[i]) if grad is None else grad)
        # on the leaves' device even when no value carries a gradient (an empty message)
        return self._join(grads, [self.likes[i] for i in self.floating], leaves[0].device)

    def unpack_grads(self, message: torch.Tensor) -> list[torch.Tensor | None]:
        """Per value, its gradient (``None`` for the values that carry none)."""
        grads = self._split(message, [self.likes[i] for i in self.floating])
        out: list[torch.Tensor | None] = [None] * len(self.likes)
        for i, g in zip(self.floating, grads, strict=True):
            out[i] = g
        return out


Codec = Single | Packed
