"""Image data sets and the tensor-pair dataset."""

from __future__ import annotations

import pytest
import torch

from syncline.data import IndexedDataset, TensorPairDataset, digits_dataset, synthetic_images
from syncline.errors import ConfigError


def test_digits_are_standardised_8x8_images() -> None:
    images, labels = digits_dataset()
    assert images.shape == (1797, 1, 8, 8)
    assert images.dtype == torch.float32
    assert labels.shape == (1797,)
    assert labels.dtype == torch.int64
    assert images.mean().item() == pytest.approx(0.0, abs=1e-5)
    assert images.std().item() == pytest.approx(1.0, abs=1e-5)
    assert sorted(labels.unique().tolist()) == list(range(10))


def test_synthetic_images_are_deterministic_and_balanced() -> None:
    x, y = synthetic_images(40, image_size=6, num_classes=4, channels=3, seed=5)
    assert x.shape == (40, 3, 6, 6)
    assert x.dtype == torch.float32
    assert y.dtype == torch.int64
    assert torch.bincount(y).tolist() == [10, 10, 10, 10]
    x2, y2 = synthetic_images(40, image_size=6, num_classes=4, channels=3, seed=5)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    x3, _ = synthetic_images(40, image_size=6, num_classes=4, channels=3, seed=6)
    assert not torch.equal(x, x3)


def test_synthetic_classes_are_separable_by_nearest_class_mean() -> None:
    x, y = synthetic_images(500, image_size=8, num_classes=10, seed=0)
    flat = x.flatten(1)
    means = torch.stack([flat[y == c].mean(0) for c in range(10)])
    predicted = torch.cdist(flat, means).argmin(1)
    assert (predicted == y).float().mean().item() > 0.9


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0}, "n=0"),
        ({"image_size": -1}, "image_size=-1"),
        ({"num_classes": 0}, "num_classes=0"),
        ({"channels": 2.0}, "channels=2.0"),
        ({"noise": -1.0}, "noise=-1.0"),
    ],
)
def test_synthetic_rejects_bad_arguments(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"n": 4, "image_size": 4, "num_classes": 2, **kwargs}
    with pytest.raises(ConfigError, match=message):
        synthetic_images(**args)  # type: ignore[arg-type]


def test_tensor_pairs_gather_batches() -> None:
    x, y = synthetic_images(10, image_size=4, num_classes=3)
    ds = TensorPairDataset(x, y)
    assert isinstance(ds, IndexedDataset)
    assert len(ds) == 10
    bx, by = ds.get(torch.tensor([9, 2, 2]))
    assert torch.equal(bx, x[[9, 2, 2]])
    assert by.tolist() == [0, 2, 2]


def test_tensor_pairs_reject_mismatched_or_empty_tensors() -> None:
    with pytest.raises(ConfigError, match=r"shape \(3, 2\) and targets of shape \(4,\)"):
        TensorPairDataset(torch.zeros(3, 2), torch.zeros(4))
    with pytest.raises(ConfigError, match="0 samples"):
        TensorPairDataset(torch.zeros(0, 2), torch.zeros(0))
