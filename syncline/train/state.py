"""What a checkpoint of a data-parallel or pipeline run holds, as the flat tensor map DCP
writes.

Everything a bit-exact continuation needs: the model (weights and buffers), the optimizer
(state and hyper-parameters), the step (the learning rate and the data position follow from
it: batches are a pure function of the step), and per rank its RNG states and its
compressor's state (CSC/TopK residuals and momentum, PowerSGD's error and ``Q``, the bucket
order). Replicated entries carry the same key on every rank, so DCP writes them once; per-rank
entries carry the rank in their key.

Plain data (the optimizer's hyper-parameters and non-tensor state, the compressor's counters)
travels as a byte tensor read back with ``weights_only=True``; tensors are pulled out into
entries of their own first, so a large optimizer state is never pickled. Any optimizer's state
is restored exactly, type for type (:mod:`syncline.train.optim_state`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from syncline.comm.sharded import pack_object, read_index, unpack_object
from syncline.dp.engine import DataParallel
from syncline.dp.precision import LossScaler
from syncline.errors import CheckpointError, ConfigError
from syncline.pipeline.runtime import Pipeline
from syncline.train.config import TrainConfig
from syncline.train.optim_state import (
    check_optimizer,
    load_optimizer,
    names_in,
    optimizer_entries,
    optimizer_keys,
)
from syncline.train.snapshots import Snapshot, SnapshotStore

__all__ = [
    "capture_dp",
    "capture_pipeline",
    "check_dp_optimizer",
    "check_pipeline_optimizers",
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


def _local_entries(rank: int, compression: dict[str, Any], **more: Any) -> dict[str, torch.Tensor]:
    local, tensors = split_tensors({"rng": _rng_state(), "compression": compression, **more})
    out = {f"rank{rank}/{i}": t.cpu() for i, t in enumerate(tensors)}
    out[f"rank{rank}/skeleton"] = pack_object(local)
    return out


def _local_state(got: dict[str, torch.Tensor], rank: int, device: torch.device) -> dict[str, Any]:
    """This rank's RNG states (set now; they stay CPU tensors, as torch takes them) and the
    rest of its own state (its compressor's; with ``sync=``, the strategy's and, saved
    between two synchronisations, its replica), returned with its tensors on ``device`` (a
    checkpoint is read into CPU tensors; CUDA gradients must meet residuals on their own
    device)."""
    skeleton = unpack_object(got[f"rank{rank}/skeleton"], f"rank {rank} state")
    tensors = _numbered(got, f"rank{rank}/")
    _set_rng_state(join_tensors(skeleton.pop("rng"), tensors))
    return dict(join_tensors(skeleton, [t.to(device) for t in tensors]))


def check_dp_optimizer(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Refuse an optimizer whose state a checkpoint cannot hold exactly (before the final
    ``checkpoint.pt``: read with ``weights_only=True``, anything else would be unreadable).

    Raises:
        CheckpointError: naming the optimizer, the entry and its type.
    """
    check_optimizer(opt, names_in(opt, {id(p): n for n, p in model.named_parameters()}))


def capture_dp(
    step: int,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    dp: DataParallel,
    rank: int,
    world: int,
    scaler: LossScaler | None = None,
) -> dict[str, torch.Tensor]:
    """The tensor map of a data-parallel run after ``step`` steps (see the module docstring);
    an fp16 run's loss scale (the same on every rank) goes into the run's metadata.

    With ``sync=`` between two synchronisations the replicas differ: rank 0's weights and
    optimizer are the shared entries (what a resharded run continues from), and each other
    rank keeps its own among its per-rank entries (``replica``)."""
    named = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, torch.Tensor] = {}
    more: dict[str, Any] = {"sync": dp.sync.state_dict()}
    if rank == 0 or dp.sync.in_sync():  # the same on every rank: written once
        out.update({f"model/{k}": v.detach().cpu() for k, v in model.state_dict().items()})
        out.update(optimizer_entries(opt, names_in(opt, named)))
    else:
        check_optimizer(opt, names_in(opt, named))
        more["replica"] = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    out.update(_local_entries(rank, dp.compression_state_dict(), **more))
    meta: dict[str, Any] = {"step": step, "world_size": world, "kind": "data-parallel"}
    if scaler is not None:
        meta["loss_scale"] = scaler.state_dict()
    out["run/meta"] = pack_object(meta)
    return out


def restore_dp(
    store: SnapshotStore,
    snap: Snapshot,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    dp: DataParallel,
    rank: int,
    world: int,
    scaler: LossScaler | None = None,
) -> tuple[int, bool]:
    """Load ``snap`` into the run's objects; returns the step to continue from, and whether
    the continuation is exact (the checkpoint's run had this shape: then each rank's RNG and
    compressor state are restored too; otherwise, resharded, they start afresh).

    Raises:
        CheckpointError: a damaged checkpoint, or one that lacks a tensor of this model.
    """
    meta = read_meta(store, snap)
    exact = meta.get("kind") == "data-parallel" and meta.get("world_size") == world
    index = read_index(snap.path)
    names = names_in(opt, {id(p): n for n, p in model.named_parameters()})
    model_keys = [f"model/{k}" for k in model.state_dict()]
    keys = model_keys + optimizer_keys(index, names)
    if exact:
        keys += [k for k in index if k.startswith(f"rank{rank}/")]
    got = store.load(snap, keys)
    device = next(model.parameters()).device
    model.load_state_dict({k[len("model/") :]: got[k].to(device) for k in model_keys})
    load_optimizer(opt, names, got)
    if exact:
        local = _local_state(got, rank, device)
        dp.load_compression_state_dict(local["compression"])
        if "sync" in local:  # (written since sync= exists)
            dp.sync.load_state_dict(local["sync"])
        if "replica" in local:  # this rank's own weights and optimizer, between syncs
            model.load_state_dict(local["replica"]["model"])
            opt.load_state_dict(local["replica"]["optimizer"])
    else:  # resharded: rank 0's replica everywhere, the strategy restarted at this step
        dp.sync.restart_at(int(meta["step"]))
    if scaler is not None and "loss_scale" in meta:
        scaler.load_state_dict(meta["loss_scale"])
    return int(meta["step"]), exact


def _numbered(got: dict[str, torch.Tensor], prefix: str) -> list[torch.Tensor]:
    tails = {k: k[len(prefix) :] for k in got if k.startswith(prefix)}
    keys = sorted((int(tail), k) for k, tail in tails.items() if tail.isdigit())
    if [i for i, _ in keys] != list(range(len(keys))):
        raise CheckpointError(f"checkpoint entries {prefix}* are not numbered 0..{len(keys) - 1}")
    return [got[k] for _, k in keys]


# -- pipelines ---------------------------------------------------------------------------------
# Each rank writes its stages' layers under the full model's names (a replica of a stage
# writes the same keys, stored once), its stages' optimizer state under the same names, and
# its own RNG and REDUCE-compressor state; the split (``balance``) goes into the metadata, as
# it was profiled at run time and an exact continuation must cut the model the same way.


def _stage_entries(pipe: Pipeline) -> dict[str, torch.Tensor]:
    """Full-model name -> tensor (parameters as themselves) of this rank's stages' state."""
    return pipe.local_state_dict(keep_vars=True)


def _device_of(entries: dict[str, torch.Tensor]) -> torch.device:
    """The device of this rank's stages (the CPU for a rank without tensors)."""
    return next((t.device for t in entries.values()), torch.device("cpu"))


def _stage_names(entries: dict[str, torch.Tensor]) -> dict[int, str]:
    """id -> full-model name of every parameter among ``entries``."""
    return {id(t): n for n, t in entries.items() if isinstance(t, nn.Parameter)}


def stage_split(pipe: Pipeline) -> list[int] | None:
    """Layers per stage, or ``None`` for a model cut at named split points (those are in
    the run's config; a traced pipeline has no balance)."""
    try:
        return pipe.balance
    except ConfigError:
        return None


def check_pipeline_optimizers(pipe: Pipeline) -> None:
    """:func:`check_dp_optimizer` for each of this rank's stages' optimizers."""
    named = _stage_names(_stage_entries(pipe))
    for opt in pipe.optimizers:
        check_optimizer(opt, names_in(opt, named))


def capture_pipeline(
    step: int,
    pipe: Pipeline,
    rank: int,
    world: int,
    schedule: str,
    split_points: tuple[str, ...] | None = None,
) -> dict[str, torch.Tensor]:
    """The tensor map of a pipeline run after ``step`` steps, with nothing in flight
    (``split_points``: where the model was cut, when not by layers)."""
    out = {f"model/{k}": v.cpu() for k, v in pipe.local_state_dict().items()}
    named = _stage_names(_stage_entries(pipe))
    for opt in pipe.optimizers:
        out.update(optimizer_entries(opt, names_in(opt, named)))
    compression = pipe.compression.state_dict() if pipe.data_parallel_size > 1 else {}
    out.update(_local_entries(rank, compression))
    meta = {"step": step, "world_size": world, "kind": "pipeline", "schedule": schedule}
    if pipe.loss_scaler is not None:  # fp16: the same scale on every rank
        meta["loss_scale"] = pipe.loss_scaler.state_dict()
    points = None if split_points is None else list(split_points)
    meta |= {"balance": stage_split(pipe), "split_points": points}
    out["run/meta"] = pack_object(meta)
    return out


def read_meta(store: SnapshotStore, snap: Snapshot) -> dict[str, Any]:
    """The checkpoint's run metadata (step, kind, world size; pipelines: balance, schedule)."""
    got = store.load(snap, ["run/meta"])
    meta = unpack_object(got["run/meta"], f"{snap.path} run/meta")
    if not isinstance(meta, dict):
        raise CheckpointError(f"{snap.path}: run/meta is {type(meta).__name__}, not a dict")
    return meta


def restore_pipeline(
    store: SnapshotStore,
    snap: Snapshot,
    pipe: Pipeline,
    rank: int,
    meta: dict[str, Any],
    exact: bool,
) -> int:
    """Load ``snap`` (whose :func:`read_meta` is ``meta``) into a pipeline (built with the
    checkpoint's balance when ``exact``); returns the step to continue from. Resharded (not
    ``exact``), each rank's RNG and compressor state start afresh."""
    index = read_index(snap.path)
    entries = _stage_entries(pipe)
    model_keys = [f"model/{k}" for k in entries]
    named = _stage_names(entries)
    keys = model_keys + optimizer_keys(index, list(named.values()))
    if exact:
        keys += [k for k in index if k.startswith(f"rank{rank}/")]
    got = store.load(snap, keys)
    step = int(meta["step"])
    model = {k[len("model/") :]: v for k, v in got.items() if k.startswith("model/")}
    pipe.load_local_state_dict(model, next_batch=step)
    for opt in pipe.optimizers:
        load_optimizer(opt, names_in(opt, named), got)
    if exact:
        local = _local_state(got, rank, _device_of(entries))
        if pipe.data_parallel_size > 1:
            pipe.compression.load_state_dict(local["compression"])
    if pipe.loss_scaler is not None and "loss_scale" in meta:
        pipe.loss_scaler.load_state_dict(meta["loss_scale"])
    return step


def same_pipeline_shape(meta: dict[str, Any], cfg: TrainConfig, world: int) -> bool:
    """Whether the checkpoint's run had this run's shape (then the continuation is exact)."""
    if (
        meta.get("kind") != "pipeline"
        or meta.get("world_size") != world
        or meta.get("schedule") != cfg.pipeline.schedule
    ):
        return False
    if cfg.pipeline.split_points is not None:  # cut at the same modules (the run's own trace)
        return meta.get("split_points") == list(cfg.pipeline.split_points)
    balance = meta.get("balance")
    return balance is not None and len(balance) == cfg.pipeline.virtual_stages
