"""Per-stage memory accounting: activations stashed for backward, and weight versions.

Activations are measured, not estimated: while a micro-batch's forward (or recompute) runs,
``torch.autograd.graph.saved_tensors_hooks`` sees every tensor autograd keeps for the
backward. Each is counted once per micro-batch by storage (views share one), weights are left
out (they are counted as versions), and the stage's input and output, which the pipeline
itself keeps until the backward, are added. A micro-batch's bytes are released when its
backward ends. With recomputation the forward keeps only the input; the recompute then
counts the rebuilt activations of that one micro-batch until its backward. Communication
buffers (gradients received ahead, activations still being sent) are not counted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StageMemoryStats:
    """Peak memory of one stage since the pipeline was built (or the last reset).

    Attributes:
        stage: the stage index.
        peak_activation_bytes: most bytes of stashed activations alive at once.
        peak_microbatches: most micro-batches between forward and end of backward at once.
        microbatch_activation_bytes: largest stash of a single micro-batch (all of its
            activations, as a backward without recomputation needs them).
        input_bytes: largest stage input of a micro-batch (what recomputation keeps).
        weight_versions: most weight versions held at once (2BW: 2; flush schedules: 1).
        peak_weight_bytes: most bytes of weight versions held at once (optimizer state is
            not included).
        autograd_measured: whether the tensors autograd saved were counted; ``False``
            (``track_memory=False``) counts only stage inputs and outputs.
    """

    stage: int
    peak_activation_bytes: int
    peak_microbatches: int
    microbatch_activation_bytes: int
    input_bytes: int
    weight_versions: int
    peak_weight_bytes: int
    autograd_measured: bool = True


def storage_key(tensor: torch.Tensor) -> tuple[int, int]:
    """``(data pointer, bytes)`` of the storage under ``tensor``."""
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def _extent(tensor: torch.Tensor) -> tuple[int, int, int]:
    """``(storage pointer, first byte, end byte)`` of the memory ``tensor`` can reach."""
    ptr = tensor.untyped_storage().data_ptr()
    if tensor.numel() == 0:
        return ptr, 0, 0
    span = 1 + sum((n - 1) * st for n, st in zip(tensor.shape, tensor.stride(), strict=True))
    start = tensor.data_ptr()
    return ptr, start, start + span * tensor.element_size()


def _union_bytes(intervals: list[tuple[int, int]]) -> int:
    total, reach = 0, None
    for start, end in sorted(intervals):
        if reach is None or start >= reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


class StashMeter:
    """Counts the bytes each in-flight micro-batch keeps for its backward.

    A micro-batch's bytes are the union of the memory its tensors reach (views of one
    buffer, such as q, k and v split from one projection, count once; slices of the batch
    count only their own rows).
    """

    def __init__(self) -> None:
        self._live: dict[object, dict[int, list[tuple[int, int]]]] = {}
        self._bytes: dict[object, int] = {}
        self.current = 0
        self.peak = 0
        self.peak_microbatches = 0
        self.microbatch_peak = 0
        self.input_peak = 0

    def add(self, key: object, tensors: Iterable[torch.Tensor]) -> None:
        """Count ``tensors`` as stashed by micro-batch ``key`` (memory shared with earlier
        tensors of ``key`` is not counted twice)."""
        owned = self._live.setdefault(key, {})
        for t in tensors:
            ptr, start, end = _extent(t)
            if end > start:
                owned.setdefault(ptr, []).append((start, end))
        before = self._bytes.get(key, 0)
        now = sum(_union_bytes(iv) for iv in owned.values())
        self._bytes[key] = now
        self.current += now - before
        self.peak = max(self.peak, self.current)
        self.peak_microbatches = max(self.peak_microbatches, len(self._live))
        self.microbatch_peak = max(self.microbatch_peak, now)

    def note_input(self, tensor: torch.Tensor) -> None:
        _, start, end = _extent(tensor)
        self.input_peak = max(self.input_peak, end - start)

    def release(self, key: object) -> None:
        """The micro-batch's backward is done: its stash is gone."""
        self._live.pop(key, None)
        self.current -= self._bytes.pop(key, 0)

    @contextmanager
    def recording(self, key: object, weights: Callable[[], set[int]]) -> Iterator[None]:
        """Count what autograd saves inside the block for micro-batch ``key``.

        ``weights()`` gives the storage pointers of weight tensors, which are not counted.
        """
        skip = weights()
        seen: list[torch.Tensor] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            if storage_key(t)[0] not in skip:
                seen.append(t)
            return t

        def unpack(t: torch.Tensor) -> torch.Tensor:
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
        self.add(key, seen)
        seen.clear()

    def reset(self) -> None:
        self.peak = self.current
        self.peak_microbatches = len(self._live)
        self.microbatch_peak = 0
        self.input_peak = 0
