"""syncline: fast, memory-efficient distributed training for PyTorch.

Public names are imported lazily, so ``import syncline`` (and the pure layers such as
``syncline.schedule``) never pulls in torch by itself.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["ConfigError", "DataParallel", "DataParallelConfig", "Pipeline", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "DataParallel":
        from syncline.dp.engine import DataParallel

        return DataParallel
    if name == "DataParallelConfig":
        from syncline.dp.config import DataParallelConfig

        return DataParallelConfig
    if name == "Pipeline":
        from syncline.pipeline.runtime import Pipeline

        return Pipeline
    if name == "ConfigError":
        from syncline.errors import ConfigError

        return ConfigError
    raise AttributeError(f"module 'syncline' has no attribute {name!r}")
