"""Data parallelism: its config, bucket plan (pure), compressor registry, and the engine.

Names are resolved lazily so that importing the pure bucket planner does not load torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Bucket": "syncline.dp.buckets",
    "BucketPlan": "syncline.dp.buckets",
    "plan_buckets": "syncline.dp.buckets",
    "BucketRef": "syncline.dp.compression",
    "Compressor": "syncline.dp.compression",
    "NoCompression": "syncline.dp.compression",
    "DataParallel": "syncline.dp.engine",
    "DataParallelConfig": "syncline.dp.config",
    "DataParallelSettings": "syncline.dp.config",
    "COMPRESSORS": "syncline.dp.registry",
    "CompressorSpec": "syncline.dp.registry",
    "build_compressor": "syncline.dp.registry",
    "StepStats": "syncline.dp.engine",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'syncline.dp' has no attribute {name!r}")
