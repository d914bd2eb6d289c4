"""Reference models, each an nn.Sequential that a pipeline partitioner can cut, by name.

The registry (:mod:`syncline.models.registry`, pure) holds every model's spec; the built-in
ones are ``gpt`` and ``cnn``. Names resolve lazily, so that the registry and the model
configs import without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "MODELS": "syncline.models.registry",
    "ModelSpec": "syncline.models.registry",
    "build_model": "syncline.models.registry",
    "model_loss": "syncline.models.registry",
    "CNNConfig": "syncline.models.configs",
    "GPTConfig": "syncline.models.configs",
    "build_cnn": "syncline.models.cnn",
    "cnn_loss": "syncline.models.cnn",
    "build_gpt": "syncline.models.gpt",
    "gpt_flops_per_token": "syncline.models.gpt",
    "lm_loss": "syncline.models.gpt",
    "gpt_layer_init": "syncline.models.gpt",
    "cnn_layer_init": "syncline.models.cnn",
    "LayerInit": "syncline.models.meta_init",
    "layer_seed": "syncline.models.meta_init",
    "materialize": "syncline.models.meta_init",
    "materialize_layers": "syncline.models.meta_init",
    "reset_parameters": "syncline.models.meta_init",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'syncline.models' has no attribute {name!r}")
