"""Shared setup of every test: the global random generators start from the same seed, and
the ranks' fork server preloads what the suite's ranks import.

As torchgpipe's conftest: a test that draws from torch's (or ``random``'s) global generator
without seeding it gets the same numbers whatever ran before it. A test that seeds on its own
still does, after this. Ranks spawned by ``syncline.testing.run_ranks`` are fresh interpreters
and seed themselves.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from syncline.testing.harness import preload

#: What the suite's ranks import anyway, imported once by the fork server instead of by each
#: rank (~2-3 s a rank of ``syncline train`` in-process, more than its steps): the trainer
#: (a rank of ``train`` or of ``plan --profile``), the tracer that splits a model at split
#: points (torch.export pulls in sympy and networkx), pyplot (rank 0 draws loss.png and
#: schedule.png), and HuggingFace's GPT-2 and ResNet (the traced pipelines' test models).
RANK_MODULES = [
    "syncline.train.worker",
    "syncline.train.pipeline_trainer",
    "syncline.train.trainer",
    "syncline.train.plan_profile",
    "torch.distributed.pipelining",
    "torch.export._trace",
    "matplotlib.pyplot",
    "matplotlib.backends.backend_agg",
    "transformers.models.gpt2.modeling_gpt2",
    "transformers.models.resnet.modeling_resnet",
]


#: What a scheduler or launcher sets (syncline.launch.clusters reads it): removed for the
#: session, so that the suite run inside a Slurm job, a pod or under torchrun tests the
#: command lines it builds, not its own placement (the tests that need one set their own).
LAUNCHER_PREFIXES = ("SLURM_", "PET_", "TORCHELASTIC_", "GROUP_", "ROLE_")
LAUNCHER_NAMES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK",
                  "LOCAL_WORLD_SIZE")  # fmt: skip


def pytest_configure(config: pytest.Config) -> None:
    del config
    for name in list(os.environ):
        if name.startswith(LAUNCHER_PREFIXES) or name in LAUNCHER_NAMES:
            del os.environ[name]
    preload(RANK_MODULES)


@pytest.fixture(autouse=True)
def manual_seed_zero() -> None:
    torch.manual_seed(0)
    random.seed(0)
