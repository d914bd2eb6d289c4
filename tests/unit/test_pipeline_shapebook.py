"""ShapeBook: when an edge's activations may travel without a shape header."""

from __future__ import annotations

import pytest
import torch

from syncline.errors import ConfigError
from syncline.pipeline.links import ShapeBook

SIG_A = ((4, 8), torch.int64)
SIG_B = ((4, 5), torch.int64)
OUT_A = ((4, 8, 16), torch.float32)
OUT_B = ((4, 5, 16), torch.float32)


def test_a_shape_is_used_two_batches_after_it_was_learnt() -> None:
    book = ShapeBook()
    book.learn(0, SIG_A, OUT_A, batch=3)
    book.learn(0, SIG_A, OUT_A, batch=4)  # a later note of the same shape changes nothing
    assert book.known(0, SIG_A, 3) is None
    assert book.known(0, SIG_A, 4) is None  # batch 3's header may not have been read yet
    assert book.known(0, SIG_A, 5) == OUT_A
    assert book.known(0, SIG_A, 50) == OUT_A


def test_each_edge_and_signature_is_learnt_apart() -> None:
    book = ShapeBook()
    book.learn(0, SIG_A, OUT_A, batch=0)
    book.learn(0, SIG_B, OUT_B, batch=1)
    assert book.known(0, SIG_A, 2) == OUT_A
    assert book.known(0, SIG_B, 2) is None
    assert book.known(0, SIG_B, 3) == OUT_B
    assert book.known(1, SIG_A, 9) is None  # another edge learnt nothing


def test_an_output_shape_that_depends_on_the_data_is_refused_naming_both() -> None:
    book = ShapeBook()
    book.learn(1, SIG_A, OUT_A, batch=0)
    with pytest.raises(ConfigError, match=r"stage 1 output \[4, 5, 16\] float32 .*\[4, 8\] int64"):
        book.learn(1, SIG_A, OUT_B, batch=7)
