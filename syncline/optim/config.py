"""PURE: ``OptimConfig``: the optimizer and its learning-rate schedule, each documented once.

A part of :class:`syncline.train.config.TrainConfig` (``cfg.optim``), and from it of the
``syncline train`` command line: the flags (``--lr``, ``--optimizer``, ...) are generated
from these fields, so the library and the command line share one declaration. What depends
on other parts stays with the whole config: the peak rate needs the global batch
(:meth:`OptimConfig.peak_lr` takes it), and whether a compressor's momentum clashes with an
adaptive optimizer needs the data-parallel settings.
"""

from __future__ import annotations

from dataclasses import dataclass

from syncline.errors import ConfigError
from syncline.fields import check_float, check_int, option
from syncline.optim.registry import OPTIMIZERS

__all__ = ["GROUP", "LR_SCALINGS", "OptimConfig"]

#: the ``--help`` section of these settings (and of the batch, steps and seed beside them)
GROUP = "optimisation"
#: ``lr_scaling``: how the peak learning rate follows the global batch
LR_SCALINGS = ("none", "linear", "sqrt")


@dataclass(frozen=True)
class OptimConfig:
    """The optimizer, its hyper-parameters and its learning-rate schedule."""

    lr: float = option(3e-3, group=GROUP)
    """Peak learning rate at ``base_batch_size`` (linear warm-up, then cosine decay to 10 %);
    ``lr_scaling`` scales it to ``batch_size``."""
    lr_scaling: str = option("none", group=GROUP, choices=lambda: LR_SCALINGS)
    """How the peak learning rate follows the batch: ``none``; ``linear``: lr x batch_size /
    base_batch_size (Goyal et al. 2017, for SGD and LARS, with warm-up); ``sqrt``: lr x
    sqrt(batch_size / base_batch_size) (for Adam and LAMB, You et al. 2019). The resolved
    value is printed at the start and saved in summary.json."""
    base_batch_size: int | None = option(None, group=GROUP, default_text="batch_size")
    """The global batch ``lr`` was tuned for."""
    optimizer: str = option("adamw", group=GROUP, choices=OPTIMIZERS.names)
    """A registered optimizer (:data:`syncline.optim.registry.OPTIMIZERS`): ``adamw``,
    ``sgd``, ``lars`` (SGD with layer-wise trust ratios, You et al. 2017), ``lamb`` (Adam
    with layer-wise trust ratios, You et al. 2019) or a plug-in's."""
    momentum: float = option(0.9, group=GROUP)
    """SGD and LARS momentum, in [0, 1); moves into the compressor when it applies momentum
    itself."""
    weight_decay: float = option(0.0, group=GROUP)
    """Decoupled weight decay."""
    warmup_steps: int = option(20, group=GROUP)
    """Linear learning-rate warm-up steps (Goyal et al. 2017), then cosine decay."""

    def __post_init__(self) -> None:
        check_float("lr", self.lr, above=0)
        check_float("momentum", self.momentum, at_least=0, below=1)
        check_float("weight_decay", self.weight_decay, at_least=0)
        check_int("warmup_steps", self.warmup_steps, low=0)
        if self.lr_scaling not in LR_SCALINGS:
            raise ConfigError(
                f"lr_scaling={self.lr_scaling!r} is not known; valid: {', '.join(LR_SCALINGS)}"
            )
        if self.base_batch_size is not None:
            check_int("base_batch_size", self.base_batch_size)
        OPTIMIZERS.get(self.optimizer)  # unknown: named, with the registered ones

    @property
    def adaptive(self) -> bool:
        """Whether the optimizer keeps a first moment of its own (Adam-like)."""
        return OPTIMIZERS.get(self.optimizer).adaptive

    def peak_lr(self, batch_size: int) -> float:
        """The peak learning rate ``lr`` scaled from ``base_batch_size`` to ``batch_size``.

        Example:
            >>> OptimConfig(lr=0.1, lr_scaling="linear", base_batch_size=32).peak_lr(256)
            0.8
        """
        ratio = batch_size / (self.base_batch_size or batch_size)
        factor: float = {"none": 1.0, "linear": ratio, "sqrt": ratio**0.5}[self.lr_scaling]
        return float(self.lr * factor)
