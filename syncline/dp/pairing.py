"""Which compressor goes with which optimizer: momentum must be applied once.

A compressor that owns the momentum (CSC's momentum correction, Lin et al. 2018) applies
heavy-ball momentum to the gradient before it sparsifies; the optimizer must then run
without a momentum of its own. Beside SGD or LARS that means ``momentum=0`` in the optimizer
(``syncline train`` moves it into the compressor). Beside an optimizer that keeps a first
moment (Adam, AdamW, LAMB, ...: every ``torch.optim`` optimizer with ``betas``) it would be
momentum twice, a different optimizer than either; the compressor's momentum must be 0 there
(error feedback alone). Every other compressor (fp16, bf16, TopK, PowerSGD) leaves momentum
to the optimizer and feeds it the compressed average, error feedback included.

``syncline train`` refuses a bad pair in its config (:class:`~syncline.train.config.TrainConfig`);
:meth:`syncline.DataParallel.attach` refuses it for a training loop of one's own.
"""

from __future__ import annotations

from typing import Any

from syncline.errors import ConfigError

__all__ = ["check_pair"]


def _owned_momentum(compressor: Any) -> float:
    """The momentum a compressor applies itself (0 when it leaves it to the optimizer)."""
    if not callable(getattr(compressor, "absorb", None)):  # only owners absorb step 0
        return 0.0
    return float(getattr(compressor, "momentum", 0.0))


def check_pair(compressor: Any, optimizer: Any) -> None:
    """Refuse ``optimizer`` beside ``compressor`` if momentum would be applied twice.

    Raises:
        ConfigError: naming the compressor, the optimizer and what would be valid.
    """
    momentum = _owned_momentum(compressor)
    if not momentum:
        return
    owner, name = compressor.name, type(optimizer).__name__
    for group in getattr(optimizer, "param_groups", []):
        if "betas" in group:
            raise ConfigError(
                f"compression {owner!r} applies momentum {momentum:g} itself and {name} "
                "keeps a first moment of its own: momentum twice. Valid: the compressor "
                f"with momentum=0 (error feedback alone, {name} keeps its moments), or SGD "
                "or LARS with momentum=0 (the compressor's momentum replaces theirs)"
            )
        if group.get("momentum"):
            raise ConfigError(
                f"compression {owner!r} applies momentum {momentum:g} itself and {name} has "
                f"momentum={group['momentum']:g}: momentum twice. Valid: {name} with "
                "momentum=0 (as syncline train builds it), or the compressor with momentum=0"
            )
