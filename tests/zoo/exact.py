"""Exact equality of nested checkpoint state: type for type at every level, tensors bit for
bit (``torch.equal`` and the same dtype), so an ``int`` that came back a ``float`` or a
tensor, or a tuple that came back a list, fails."""

from __future__ import annotations

import torch


def assert_exact(a: object, b: object, where: str, *, key_order: bool = True) -> None:
    """``a`` and ``b`` equal, type for type, dict keys in the same order (or, with
    ``key_order=False``, the same keys: a resumed optimizer's state is filled in another
    order); ``where`` names the entry in the failure."""
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict)
        same = list(a) == list(b) if key_order else a.keys() == b.keys()
        assert same, (where, list(a), list(b))
        for k in a:
            assert_exact(a[k], b[k], f"{where}.{k}", key_order=key_order)
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_exact(x, y, f"{where}[{i}]", key_order=key_order)
    else:
        assert a == b, (where, a, b)
