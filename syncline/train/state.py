"""What a checkpoint of a data-parallel or pipeline run holds, as the flat tensor map DCP
writes.

Everything a bit-exact continuation needs: the model (weights and buffers), the optimizer
(state and hyper-parameters), the step (the learning rate and the data position follow from
it: batches are a pure function of the step), and per rank its RNG states and its
compressor's state (CSC/TopK residuals and momentum, PowerSGD's error and ``Q``, the bucket
order). Replicated entries carry the same key on every rank, so DCP writes them once; per-rank
entries carry the rank in their key.

Plain data (the optimizer's hyper-parameters, the compressor's counters) travels as a byte
tensor read back with ``weights_only=True``; tensors inside it are pulled out into entries of
their own first, so a large optimizer state is never pickled.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from syncline.comm.sharded import pack_object, read_index, unpack_object
from syncline.dp.engine import DataParallel
from syncline.errors import CheckpointError
from syncline.pipeline.runtime import Pipeline
from syncline.train.snapshots import Snapshot, SnapshotStore

__all__ = [
    "capture_dp",
    "capture_pipeline",
    "join_tensors",
    "read_meta",
    "restore_dp",
    "restore_pipeline",
    "split_tensors",
]

_TENSOR = "__syncline_tensor__"


def split_tensors(
    obj: Any, out: list[torch.Tensor] | None = None
) -> tuple[Any, list[torch.Tensor]]:
    """``obj`` with every tensor replaced by a numbered placeholder, and the tensors."""
    found = [] if out is None else out
    if isinstance(obj, torch.Tensor):
        found.append(obj.detach())
        return {_TENSOR: len(found) - 1}, found
    if isinstance(obj, dict):
        return {k: split_tensors(v, found)[0] for k, v in obj.items()}, found
    if isinstance(obj, list | tuple):
        items = [split_tensors(v, found)[0] for v in obj]
        return (items if isinstance(obj, list) else tuple(items)), found
    return obj, found


def join_tensors(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """The inverse of :func:`split_tensors`."""
    if isinstance(skeleton, dict):
        if set(skeleton) == {_TENSOR}:
            return tensors[skeleton[_TENSOR]]
        return {k: join_tensors(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, list | tuple):
        items = [join_tensors(v, tensors) for v in skeleton]
        return items if isinstance(skeleton, list) else tuple(items)
    return skeleton


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def capture_dp(
    step: int, model: nn.Module, opt: torch.optim.Optimizer, dp: DataParallel, rank: int, world: int
) -> dict[str, torch.Tensor]:
    """The tensor map of a data-parallel run after ``step`` steps (see the module docstring)."""
    out = {f"model/{k}": v.detach().cpu() for k, v in model.state_dict().items()}
    skeleton, tensors = split_tensors(opt.state_dict())
    out.update({f"optim/{i}": t.cpu() for i, t in enumerate(tensors)})
    out["optim/skeleton"] = pack_object(skeleton)
    local, local_tensors = split_tensors(
        {"rng": _rng_state(), "compression": dp.compression_state_dict()}
    )
    out.update({f"rank{rank}/{i}": t.cpu() for i, t in enumerate(local_tensors)})
    out[f"rank{rank}/skeleton"] = pack_object(local)
    out["run/meta"] = pack_object({"step": step, "world_size": world, "kind": "data-parallel"})
    return out


def restore_dp(
    store: SnapshotStore,
    snap: Snapshot,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    dp: DataParallel,
    rank: int,
    world: int,
) -> int:
    """Load ``snap`` into the run's objects; returns the step to continue from.

    Raises:
        CheckpointError: a damaged checkpoint, one of another kind or world size, or one
            whose model does not match (naming the first difference).
    """
    index = read_index(snap.path)
    model_keys = [f"model/{k}" for k in model.state_dict()]
    keys = model_keys + [k for k in index if k.startswith(("optim/", f"rank{rank}/", "run/"))]
    got = store.load(snap, keys)
    meta = unpack_object(got["run/meta"], f"{snap.path} run/meta")
    if meta.get("kind") != "data-parallel" or meta.get("world_size") != world:
        raise CheckpointError(
            f"{snap.path} was written by a {meta.get('kind')} run of {meta.get('world_size')} "
            f"ranks; this run is data-parallel on {world} (resharding a data-parallel "
            "checkpoint is not supported yet)"
        )
    device = next(model.parameters()).device
    model.load_state_dict({k[len("model/") :]: got[k].to(device) for k in model_keys})
    opt_tensors = _numbered(got, "optim/")
    opt.load_state_dict(
        join_tensors(unpack_object(got["optim/skeleton"], "optimizer state"), opt_tensors)
    )
    local = join_tensors(
        unpack_object(got[f"rank{rank}/skeleton"], f"rank {rank} state"),
        _numbered(got, f"rank{rank}/"),
    )
    _set_rng_state(local["rng"])
    dp.load_compression_state_dict(local["compression"])
    return int(meta["step"])


def _numbered(got: dict[str, torch.Tensor], prefix: str) -> list[torch.Tensor]:
    tails = {k: k[len(prefix) :] for k in got if k.startswith(prefix)}
    keys = sorted((int(tail), k) for k, tail in tails.items() if tail.isdigit())
    if [i for i, _ in keys] != list(range(len(keys))):
        raise CheckpointError(f"checkpoint entries {prefix}* are not numbered 0..{len(keys) - 1}")
    return [got[k] for _, k in keys]


# -- pipelines ---------------------------------------------------------------------------------
# Each rank writes its stages' layers under the full model's names (a replica of a stage
# writes the same keys, stored once), each stage's optimizer under the stage's number, and
# its own RNG and REDUCE-compressor state; the split (``balance``) goes into the metadata, as
# it was profiled at run time and the continuation must cut the model the same way.


def capture_pipeline(
    step: int, pipe: Pipeline, rank: int, world: int, schedule: str
) -> dict[str, torch.Tensor]:
    """The tensor map of a pipeline run after ``step`` steps, with nothing in flight."""
    out = {f"model/{k}": v.cpu() for k, v in pipe.local_state_dict().items()}
    for s, opt in zip(pipe.stages, pipe.optimizers, strict=True):
        skeleton, tensors = split_tensors(opt.state_dict())
        out.update({f"optim/stage{s}/{i}": t.cpu() for i, t in enumerate(tensors)})
        out[f"optim/stage{s}/skeleton"] = pack_object(skeleton)
    compression = pipe.compression.state_dict() if pipe.data_parallel_size > 1 else {}
    local, local_tensors = split_tensors({"rng": _rng_state(), "compression": compression})
    out.update({f"rank{rank}/{i}": t.cpu() for i, t in enumerate(local_tensors)})
    out[f"rank{rank}/skeleton"] = pack_object(local)
    meta = {"step": step, "world_size": world, "kind": "pipeline", "schedule": schedule}
    out["run/meta"] = pack_object({**meta, "balance": pipe.balance})
    return out


def read_meta(store: SnapshotStore, snap: Snapshot) -> dict[str, Any]:
    """The checkpoint's run metadata (step, kind, world size; pipelines: balance, schedule)."""
    got = store.load(snap, ["run/meta"])
    meta = unpack_object(got["run/meta"], f"{snap.path} run/meta")
    if not isinstance(meta, dict):
        raise CheckpointError(f"{snap.path}: run/meta is {type(meta).__name__}, not a dict")
    return meta


def restore_pipeline(
    store: SnapshotStore, snap: Snapshot, pipe: Pipeline, rank: int, meta: dict[str, Any]
) -> int:
    """Load ``snap`` into a pipeline built with the checkpoint's balance; returns the step to
    continue from."""
    index = read_index(snap.path)
    stage_keys = [f"optim/stage{s}/" for s in pipe.stages]
    keys = [k for k in index if k.startswith(("model/", f"rank{rank}/", *stage_keys))]
    got = store.load(snap, keys)
    step = int(meta["step"])
    model = {k[len("model/") :]: v for k, v in got.items() if k.startswith("model/")}
    pipe.load_local_state_dict(model, next_batch=step)
    for s, opt in zip(pipe.stages, pipe.optimizers, strict=True):
        prefix = f"optim/stage{s}/"
        skeleton = unpack_object(got[prefix + "skeleton"], f"stage {s} optimizer state")
        opt.load_state_dict(join_tensors(skeleton, _numbered(got, prefix)))
    local = join_tensors(
        unpack_object(got[f"rank{rank}/skeleton"], f"rank {rank} state"),
        _numbered(got, f"rank{rank}/"),
    )
    _set_rng_state(local["rng"])
    if pipe.data_parallel_size > 1:
        pipe.compression.load_state_dict(local["compression"])
    return step
