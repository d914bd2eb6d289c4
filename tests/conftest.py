"""Shared setup of every test: the global random generators start from the same seed.

As torchgpipe's conftest: a test that draws from torch's (or ``random``'s) global generator
without seeding it gets the same numbers whatever ran before it. A test that seeds on its own
still does, after this. Ranks spawned by ``syncline.testing.run_ranks`` are fresh interpreters
and seed themselves.
"""

from __future__ import annotations

import random

import pytest
import torch


@pytest.fixture(autouse=True)
def manual_seed_zero() -> None:
    torch.manual_seed(0)
    random.seed(0)
