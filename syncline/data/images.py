"""Small image classification sets that need no download: sklearn's digits and a synthetic set."""

from __future__ import annotations

import torch

from syncline.fields import check_float, check_int

__all__ = ["digits_dataset", "synthetic_images"]


def digits_dataset() -> tuple[torch.Tensor, torch.Tensor]:
    """The UCI hand-written digits bundled with scikit-learn (1797 images of 8x8 pixels).

    Pixels are standardised with the mean and standard deviation over the whole set (one
    scalar each; several border pixels are always blank, so per-pixel scaling would divide
    by zero).

    Returns:
        ``(images, labels)``: float32 (1797, 1, 8, 8) with zero mean and unit variance, and
        int64 (1797,) class ids in 0..9. Wrap them in ``TensorPairDataset`` to sample them.
    """
    from sklearn.datasets import load_digits  # lazy: sklearn is slow to import

    digits = load_digits()
    images = torch.as_tensor(digits.images, dtype=torch.float32).unsqueeze(1)
    images = (images - images.mean()) / images.std()
    labels = torch.as_tensor(digits.target, dtype=torch.int64)
    return images, labels


def synthetic_images(
    n: int,
    image_size: int,
    num_classes: int,
    channels: int = 1,
    seed: int = 0,
    noise: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Class-conditional random images: one fixed pattern per class plus Gaussian noise.

    Each class has a prototype image drawn from N(0, 1); sample ``i`` has label
    ``i % num_classes`` (so classes are balanced) and is its prototype plus
    ``noise * N(0, 1)``. With the default noise a small CNN separates the classes in a few
    dozen steps. Everything is drawn from a private generator seeded with ``seed``.

    Args:
        n: number of images, >= 1.
        image_size: side of the square images, >= 1.
        num_classes: number of classes, >= 1.
        channels: channels per image, >= 1.
        seed: seed of the generator; the same arguments always give the same tensors.
        noise: standard deviation of the per-pixel noise, >= 0.

    Returns:
        ``(images, labels)``: float32 (n, channels, image_size, image_size) and int64 (n,).

    Raises:
        ConfigError: if a size is not a positive int or ``noise`` is negative.

    Example:
        >>> x, y = synthetic_images(6, image_size=4, num_classes=3)
        >>> x.shape, y.tolist()
        (torch.Size([6, 1, 4, 4]), [0, 1, 2, 0, 1, 2])
    """
    for name, value in (
        ("n", n),
        ("image_size", image_size),
        ("num_classes", num_classes),
        ("channels", channels),
    ):
        check_int(name, value)
    check_float("noise", noise, at_least=0, finite=False)
    gen = torch.Generator().manual_seed(seed)
    shape = (channels, image_size, image_size)
    prototypes = torch.randn((num_classes, *shape), generator=gen)
    labels = torch.arange(n, dtype=torch.int64) % num_classes
    images = prototypes[labels] + noise * torch.randn((n, *shape), generator=gen)
    return images, labels
