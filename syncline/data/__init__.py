"""Reference data sets and deterministic rank-aware batching; nothing is read at import.

Names resolve lazily, so that the data-set registry imports without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DATASETS": "syncline.data.registry",
    "DatasetSpec": "syncline.data.registry",
    "build_dataset": "syncline.data.registry",
    "IndexedDataset": "syncline.data.dataset",
    "TensorPairDataset": "syncline.data.dataset",
    "digits_dataset": "syncline.data.images",
    "synthetic_images": "syncline.data.images",
    "IndexRange": "syncline.data.heldout",
    "holdout": "syncline.data.heldout",
    "ShardedBatches": "syncline.data.sampler",
    "step_seed": "syncline.data.sampler",
    "ByteDataset": "syncline.data.text",
    "stdlib_corpus": "syncline.data.text",
    "stdlib_files": "syncline.data.text",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'syncline.data' has no attribute {name!r}")
