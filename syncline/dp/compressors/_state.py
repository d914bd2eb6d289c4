"""Per-bucket state tensors (residuals, momenta, factors) and their checkpoint form.

Compressors key state on :attr:`BucketRef.index`; a checkpoint holds plain clones so that
``load_state_dict`` restores the exact bits and the next step is bit-identical. Restored
state may sit on another device than the gradients (the CPU, where a checkpoint is read):
:func:`to_device` moves it at its bucket's next reduction.
"""

from __future__ import annotations

from typing import Any

import torch

from syncline.errors import ConfigError

BucketState = dict[int, dict[str, torch.Tensor]]


def save_buckets(buckets: BucketState) -> dict[int, dict[str, torch.Tensor]]:
    """Deep copy of every bucket's tensors (so later steps cannot change the checkpoint)."""
    return {i: {k: t.detach().clone() for k, t in d.items()} for i, d in buckets.items()}


def load_buckets(state: Any, owner: str) -> BucketState:
    """Inverse of :func:`save_buckets`, with a readable error on a malformed checkpoint."""
    if not isinstance(state, dict):
        raise ConfigError(f"{owner}: bucket state must be a dict, got {type(state).__name__}")
    return {int(i): {k: t.detach().clone() for k, t in d.items()} for i, d in state.items()}


def to_device(
    state: dict[str, torch.Tensor], device: torch.device, host: tuple[str, ...] = ()
) -> None:
    """Move one bucket's state tensors to ``device`` in place (but the ``host`` ones, which
    stay on the CPU), where they are not already.

    Why lazily, at the bucket's next reduction, rather than in ``load_state_dict``: a
    checkpoint is read on the CPU (``map_location``), and only the gradient a compressor
    meets says which device its state belongs on; so callers restore as before and pass
    nothing new. A copy happens once after a restore, never in the steady state.
    """
    for name, t in state.items():
        want = torch.device("cpu") if name in host else device
        if t.device != want:
            state[name] = t.to(want)


def check_numel(owner: str, index: int, have: torch.Tensor, numel: int) -> None:
    """A saved bucket must match the bucket it is applied to (same layout as when saved)."""
    if have.numel() != numel:
        raise ConfigError(
            f"{owner}: bucket {index} has {numel} elements but its state has "
            f"{have.numel()}; the bucket layout changed since the state was created "
            "(load the checkpoint into a model with the same parameters and bucket_cap_mb)"
        )
