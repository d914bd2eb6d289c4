"""Reference models, each an nn.Sequential that a pipeline partitioner can cut, by name."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from syncline.errors import ConfigError
from syncline.models.cnn import CNNConfig, build_cnn, cnn_loss
from syncline.models.gpt import GPTConfig, build_gpt, gpt_flops_per_token, lm_loss

__all__ = [
    "MODEL_NAMES",
    "CNNConfig",
    "GPTConfig",
    "build_cnn",
    "build_gpt",
    "build_model",
    "cnn_loss",
    "gpt_flops_per_token",
    "lm_loss",
    "model_loss",
]

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

MODEL_NAMES: tuple[str, ...] = ("gpt", "cnn")

_CONFIGS: dict[str, type[Any]] = {"gpt": GPTConfig, "cnn": CNNConfig}
_BUILDERS: dict[str, Callable[[Any], nn.Sequential]] = {"gpt": build_gpt, "cnn": build_cnn}
_LOSSES: dict[str, Loss] = {"gpt": lm_loss, "cnn": cnn_loss}


def _check_name(name: str) -> None:
    if name not in MODEL_NAMES:
        raise ConfigError(f"unknown model {name!r}; valid: {', '.join(MODEL_NAMES)}")


def build_model(name: str, **overrides: Any) -> nn.Sequential:
    """Build a reference model from its default config with some fields overridden.

    Args:
        name: one of ``MODEL_NAMES``.
        **overrides: fields of that model's config (``GPTConfig`` or ``CNNConfig``).

    Returns:
        The model as an ``nn.Sequential``.

    Raises:
        ConfigError: for an unknown name, an unknown field or an invalid value.

    Example:
        >>> model = build_model("gpt", n_layer=2, n_embd=32)
        >>> len(model)
        4
    """
    _check_name(name)
    config_cls = _CONFIGS[name]
    valid = [f.name for f in dataclasses.fields(config_cls)]
    unknown = sorted(set(overrides) - set(valid))
    if unknown:
        raise ConfigError(
            f"unknown option {unknown[0]!r} for model {name!r}; valid: {', '.join(valid)}"
        )
    return _BUILDERS[name](config_cls(**overrides))


def model_loss(name: str) -> Loss:
    """The loss function ``loss(output, target) -> scalar`` that goes with a model.

    Raises:
        ConfigError: for an unknown name.
    """
    _check_name(name)
    return _LOSSES[name]
