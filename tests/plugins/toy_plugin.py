"""A third-party plug-in, as a user would write it: one registration per extension point.

It uses only syncline's public registries, never edits syncline, and registers at import,
so ``syncline train --plugin tests.plugins.toy_plugin`` makes its entries available in the
command line and in every rank. Registration replaces earlier entries of the same name;
tests call :func:`register` and :func:`unregister` around themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from syncline.comm import ALLREDUCE, AllreduceSpec, FlatAllreduce
from syncline.data import DATASETS, DatasetSpec, TensorPairDataset
from syncline.dp import COMPRESSORS, BucketRef, CompressorSpec
from syncline.models import MODELS, ModelSpec
from syncline.schedule import SCHEDULES, Action, ActionKind, Schedule, ScheduleSpec, add_recompute


class ToyMean:
    """Averages a bucket in float64 on the wire (a made-up compressor; counts its calls)."""

    name = "toymean"
    stateless = True
    calls = 0

    def reduce(self, bucket: BucketRef, grad: torch.Tensor, comm: Any) -> Any:
        type(self).calls += 1
        grad.mul_(1.0 / comm.world_size)
        return comm.allreduce(grad, f"toymean of bucket {bucket.index} at step {bucket.step}")

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state


def toymean_traffic(numel: int, matrices: Any, value_bytes: int, **_: Any) -> list:
    """ToyMean's traffic model, for the planner: the bucket as it is, in one allreduce."""
    del matrices
    return [("allreduce", value_bytes * numel)]


def lifo(d: int, m: int, chunks: int, recompute: bool) -> Schedule:
    """GPipe's forwards, then the backwards in reverse micro-batch order (last in, first out)."""
    del chunks
    rows = {
        r: [Action(r, ActionKind.FORWARD, i) for i in range(m)]
        + [Action(r, ActionKind.BACKWARD, i) for i in reversed(range(m))]
        + [Action(r, ActionKind.REDUCE), Action(r, ActionKind.STEP)]
        for r in range(d)
    }
    if recompute:
        rows = {r: add_recompute(acts) for r, acts in rows.items()}
    return Schedule("toy-lifo", d, m, rows)


@dataclass(frozen=True)
class ToyMLPConfig:
    """Shape of the toy MLP."""

    inputs: int = 16
    """Features per sample."""
    hidden: int = 32
    """Width of the hidden layers."""
    depth: int = 2
    """Hidden layers."""
    classes: int = 4
    """Output logits."""


def build_mlp(cfg: ToyMLPConfig) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Linear(cfg.inputs, cfg.hidden), nn.Tanh()]
    for _ in range(cfg.depth - 1):
        layers += [nn.Linear(cfg.hidden, cfg.hidden), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(cfg.hidden, cfg.classes))


def mlp_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, targets)


def blobs(seq_len: int, seed: int) -> tuple[TensorPairDataset, int]:
    """4 Gaussian blobs in 16 dimensions, 1024 points: easy to learn, fast to train."""
    del seq_len
    gen = torch.Generator().manual_seed(seed)
    centres = 3 * torch.randn(4, 16, generator=gen)
    labels = torch.randint(4, (1024,), generator=gen)
    points = centres[labels] + torch.randn(1024, 16, generator=gen)
    return TensorPairDataset(points, labels), 1


#: (registry, name) of every entry this plug-in adds, for :func:`unregister`
ENTRIES = [
    (COMPRESSORS, "toymean"),
    (SCHEDULES, "toy-lifo"),
    (DATASETS, "toy-blobs"),
    (MODELS, "toy-mlp"),
    (ALLREDUCE, "toy-ring"),
]


def register() -> None:
    """Add the plug-in's entries (again: an existing entry of the same name is replaced)."""
    COMPRESSORS.register(
        CompressorSpec("toymean", "the toy plug-in's mean", ToyMean, traffic=toymean_traffic),
        replace=True,
    )
    SCHEDULES.register(ScheduleSpec("toy-lifo", "backwards last in, first out", lifo), replace=True)
    DATASETS.register(DatasetSpec("toy-blobs", "Gaussian blobs", blobs), replace=True)
    MODELS.register(
        ModelSpec(
            "toy-mlp",
            "a small MLP",
            ToyMLPConfig,
            build=build_mlp,
            loss=mlp_loss,
            datasets=("toy-blobs",),
            num_layers=lambda c: 2 * c.depth + 1,
            flags={"hidden": "--toy-hidden"},
        ),
        replace=True,
    )
    ALLREDUCE.register(
        AllreduceSpec(
            "toy-ring",
            "FlatAllreduce under another name",
            lambda group, timeout_s, ranks_per_node: FlatAllreduce(group, timeout_s=timeout_s),
        ),
        replace=True,
    )


def unregister() -> None:
    """Remove the plug-in's entries (tests leave the registries as they found them)."""
    for registry, name in ENTRIES:
        registry.unregister(name)


register()  # what `--plugin tests.plugins.toy_plugin` relies on
