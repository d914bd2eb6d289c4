"""Layer-wise adaptive optimizers for large batches: LARS and LAMB.

Both rescale each parameter tensor's update by a trust ratio ``||w|| / ||update||``, so that
a layer's step is a fixed fraction of its weights whatever the batch size; that is what lets
a learning rate scaled with the batch keep converging (You et al. 2017, 2019). The ratio is
per tensor and computed on the whole gradient: under data parallelism the all-reduced one
(the optimizer steps after the average), under 2BW the delayed one the stage steps with.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Lamb", "Lars"]


def __getattr__(name: str) -> Any:
    """``Lamb`` and ``Lars`` on first use: the optimizer registry
    (:mod:`syncline.optim.registry`) is read by pure modules that must not load torch."""
    if name == "Lamb":
        from syncline.optim.lamb import Lamb

        return Lamb
    if name == "Lars":
        from syncline.optim.lars import Lars

        return Lars
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
