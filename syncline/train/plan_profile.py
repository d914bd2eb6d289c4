"""One rank of ``syncline plan --profile``: measure this machine's costs for the planner.

``python -m syncline.train.plan_profile CONFIG.json OUT.json EMULATED`` under torchrun, every
rank at once (as in training, the ranks share the machine's cores and memory bandwidth while
they are timed). Rank 0 writes ``OUT.json``: ``{"cluster": ..., "model": ...}``, the
:class:`~syncline.planner.hardware.Cluster` and :class:`~syncline.planner.costs.ModelCosts`
the planner reads. What is measured, and how each number is fitted:

- each layer's forward and backward at two micro-batch sizes, and the loss: ``fixed +
  per_sample * b`` through the two points (``syncline.pipeline.profile``), scaled so that
  the layers and the loss add up to the whole model's measured forward + backward at that
  size (a layer timed alone, again and again, runs from warm caches and without the
  autograd engine's walk over the whole graph; a training step has neither);
- the optimizer step over all parameters (per parameter), copying a weight version (per byte),
  and fetching a batch (the step's overhead outside the model);
- each compressor's local work on the model's gradient buckets (world size 1, before the
  process group exists, so its collectives cost nothing), per gradient byte;
- point-to-point ping-pong between ranks 0 and 1 (latency and bandwidth, least squares) and
  allreduces over all ranks (the summing cost per byte on top of the wire);
- how much a forward + backward slows while an allreduce runs beside it;
- the memory a rank of ``syncline train`` holds before its model (its peak memory, the
  trainer's modules loaded), and the workspace of a step: the peak of two real steps at
  each micro-batch size less that base, the model state and the stashed activations.

Each rank profiles the device and the backend ``syncline train`` would give it with the same
options (:func:`~syncline.train.common.rank_backend_and_device`: a GPU and NCCL on a GPU
node), times device work with :class:`~syncline.comm.device.Stopwatch` (CUDA events on a
GPU) and measures memory with :func:`~syncline.comm.device.peak_memory_bytes` (the CUDA
allocator's peak on a GPU, the resident set on the CPU), as the run summary does; a GPU's
memory per rank is its capacity.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record

from syncline import comm
from syncline.comm.collectives import FlatAllreduce
from syncline.comm.device import Stopwatch, peak_memory_bytes
from syncline.comm.probe import overlap_slowdown, own_group, time_allreduce, time_ping_pong
from syncline.data import ShardedBatches
from syncline.dp.buckets import plan_buckets
from syncline.dp.compression import BucketRef
from syncline.dp.compressors import build_compressor
from syncline.dp.config import DataParallelConfig
from syncline.pipeline.profile import profile_layers
from syncline.planner.costs import Affine, LayerCost, ModelCosts
from syncline.planner.hardware import Cluster, Link
from syncline.planner.search import default_compressions
from syncline.train.common import (
    build_dataset,
    build_model_for,
    loss_for,
    make_optimizer,
    rank_backend_and_device,
)
from syncline.train.config import TrainConfig

P2P_SIZES = (4096, 65536, 1 << 20, 4 << 20, 16 << 20)
ALLREDUCE_SIZES = (65536, 1 << 20, 4 << 20, 16 << 20)


def _median_time(fn: Callable[[], None], device: torch.device, repeats: int = 5) -> float:
    """Median seconds of ``fn``'s work on ``device`` over ``repeats`` runs after a warm-up."""
    fn()
    watch = Stopwatch(device)
    times = []
    for _ in range(repeats):
        watch.start()
        fn()
        times.append(watch.stop().elapsed_s())
    return statistics.median(times)


def _fit_link(sizes: tuple[int, ...], seconds: list[float]) -> Link:
    """Least squares ``t = latency + n / bandwidth``."""
    n = len(sizes)
    mx, my = sum(sizes) / n, sum(seconds) / n
    sxx = sum((x - mx) ** 2 for x in sizes)
    slope = sum((x - mx) * (y - my) for x, y in zip(sizes, seconds, strict=True)) / sxx
    slope = max(slope, 1e-15)
    return Link(1.0 / slope, max(my - slope * mx, 0.0))


def _layers(model: nn.Module) -> nn.Sequential:
    if not isinstance(model, nn.Sequential):
        raise SystemExit(
            f"plan --profile needs an nn.Sequential model (what a pipeline cuts), got "
            f"{type(model).__name__}"
        )
    return model


def _model_costs(
    cfg: TrainConfig, model: nn.Sequential, sizes: tuple[int, int], rank: int, world: int
) -> ModelCosts:
    device = next(model.parameters()).device
    dataset, tokens = build_dataset(cfg)
    loss_fn = loss_for(cfg)
    profiles, losses, samples = [], [], []
    scales: list[float] = []  # the whole model's forward + backward over the sum of its parts
    for b in sizes:
        x, y = _on(device, ShardedBatches(dataset, b * world, rank, world, cfg.seed).batch(0))
        samples.append(x)
        profiles.append(profile_layers(model, x, repeats=5))
        with torch.no_grad():
            out = model(x)

        def loss_step(out: torch.Tensor = out, y: torch.Tensor = y) -> None:
            z = out.detach().requires_grad_(True)
            loss_fn(z, y).backward()

        losses.append(_median_time(loss_step, device))

        def whole(x: torch.Tensor = x, y: torch.Tensor = y) -> None:
            model.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()

        parts = sum(profiles[-1].seconds) + losses[-1]
        scales.append(_median_time(whole, device) / parts if parts > 0 else 1.0)
    model.zero_grad(set_to_none=True)
    (b1, b2), (p1, p2), (s1, s2) = sizes, profiles, scales
    losses = [losses[0] * s1, losses[1] * s2]
    layers = []
    for i, layer in enumerate(model):
        f1, f2 = p1.forward_seconds[i] * s1, p2.forward_seconds[i] * s2
        matrices = tuple(
            (int(p.shape[0]), int(p.numel() // p.shape[0]))
            for p in layer.parameters()
            if p.dim() >= 2
        )
        layers.append(
            LayerCost(
                name=f"{i}:{type(layer).__name__}",
                forward=Affine.fit(b1, f1, b2, f2),
                backward=Affine.fit(b1, p1.seconds[i] * s1 - f1, b2, p2.seconds[i] * s2 - f2),
                params=p2.params[i],
                activation_bytes=p2.activation_bytes[i] / b2,
                output_bytes=p2.output_bytes[i] / b2,
                matrices=matrices,
            )
        )
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = make_optimizer(cfg, params)
    update = _median_time(opt.step, device)
    x0 = samples[-1]
    return ModelCosts(
        name=cfg.model,
        layers=tuple(layers),
        input_bytes=x0.numel() * x0.element_size() / x0.shape[0],
        param_bytes=4,
        tokens_per_sample=tokens,
        update_s_per_param=update / max(1, sum(p.numel() for p in params)),
        loss=Affine.fit(b1, losses[0], b2, losses[1]),
    )


def _compressor_costs(model: nn.Module, solo: FlatAllreduce) -> dict[str, float]:
    """Seconds per gradient byte of each compressor's local work (a one-rank group)."""
    params = [p for p in model.parameters() if p.requires_grad]
    dp = DataParallelConfig()
    order = list(reversed(range(len(params))))
    plan = plan_buckets([p.numel() for p in params], order, 4, dp.cap_bytes, dp.first_cap_bytes)
    buckets = [
        (
            b.start,
            b.end,
            tuple((plan.offsets[i] - b.start, tuple(params[i].shape)) for i in b.params),
        )
        for b in plan.buckets
    ]
    total = buckets[-1][1]
    device = params[0].device
    flat = torch.randn(total, generator=torch.Generator().manual_seed(0)).to(device)
    out = {}
    for spec in default_compressions():
        name = spec.split(":")[0]
        comp = build_compressor(spec)
        step = [0]

        def run(comp: Any = comp, step: list[int] = step) -> None:
            step[0] += 1
            pending = [
                comp.reduce(BucketRef(i, step[0] + 10_000, layout), flat[a:b], solo)
                for i, (a, b, layout) in enumerate(buckets)
            ]
            for p in pending:
                p.wait()

        out[name] = _median_time(run, device) / (4 * total)
    base = out.get("none", 0.0)
    return {k: max(v - base, 0.0) for k, v in out.items()}


def _other_costs(cfg: TrainConfig, model: nn.Module, rank: int, world: int) -> dict[str, float]:
    dataset, _ = build_dataset(cfg)
    batches = ShardedBatches(dataset, cfg.batch_size, rank, world, cfg.seed)
    params = list(model.parameters())
    copies = [p.detach().clone() for p in params]
    step = [0]

    def fetch() -> None:
        step[0] += 1
        batches.batch(step[0])

    def copy() -> None:
        for c, p in zip(copies, params, strict=True):
            c.copy_(p)

    nbytes = sum(p.numel() * p.element_size() for p in params)
    device = params[0].device
    return {
        "step_overhead_s": _median_time(fetch, torch.device("cpu")),  # host work
        "update_s_per_byte": _median_time(copy, device) / max(1, nbytes),
    }


def _on(
    device: torch.device, batch: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch moved to ``device``, as the trainers move theirs."""
    return batch[0].to(device), batch[1].to(device)


def _peak_bytes(device: torch.device) -> int:
    """This rank's peak memory so far on ``device`` (what ``syncline train`` reports)."""
    return peak_memory_bytes(device).bytes


def _capacity(device: torch.device, ranks: int) -> int:
    """The memory one rank may hold: its GPU's, or on the CPU the machine's share of the
    ``ranks`` profiled on it (emulated nodes share this machine too)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(1, ranks)


def _step_peaks(
    cfg: TrainConfig, model: nn.Sequential, sizes: tuple[int, int], rank: int, world: int
) -> list[tuple[int, int]]:
    """(peak resident bytes, model state bytes) after two real training steps (forward,
    loss, backward, the run's optimizer) at each micro-batch size, smallest first: the
    peak only grows, so each size's peak is its own. Run before anything else allocates."""
    dataset, _ = build_dataset(cfg)
    loss_fn = loss_for(cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    device = params[0].device
    opt = make_optimizer(cfg, params)
    out = []
    for b in sizes:
        x, y = _on(device, ShardedBatches(dataset, b * world, rank, world, cfg.seed).batch(1))
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            opt.step()
        state = sum(p.numel() * p.element_size() * 2 for p in params)  # weights, grads
        state += sum(
            t.numel() * t.element_size()
            for st in opt.state.values()
            for t in st.values()
            if isinstance(t, torch.Tensor)
        )
        out.append((_peak_bytes(device), state))
    opt.zero_grad(set_to_none=True)
    return out


def _with_workspace(
    costs: ModelCosts, sizes: tuple[int, int], peaks: list[tuple[int, int]], base: int
) -> ModelCosts:
    """``costs`` with the workspace fitted: each size's peak less the base, the model
    state and the activations the layers stash (their measured saved tensors)."""
    stash = sum(layer.activation_bytes for layer in costs.layers) + costs.input_bytes
    extra = [
        max(peak - base - state - stash * b, 0)
        for b, (peak, state) in zip(sizes, peaks, strict=True)
    ]
    workspace = Affine.fit(sizes[0], extra[0], sizes[1], extra[1])
    return dataclasses.replace(costs, workspace=workspace)


@record
def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3:
        print("usage: python -m syncline.train.plan_profile CONFIG OUT EMULATED", file=sys.stderr)
        return 2
    cfg = TrainConfig.from_dict(json.loads(Path(args[0]).read_text()))
    emulated = args[2] == "1"
    torch.set_num_threads(cfg.threads)
    # the device and backend a rank of ``syncline train`` with these options would get
    backend, device = rank_backend_and_device(cfg, int(os.environ.get("LOCAL_RANK", "0")))
    rank, world = comm.init_from_env(backend=backend, timeout_s=cfg.timeout_s)
    try:
        # The base is what a rank of ``syncline train`` holds before its model: the
        # framework, the process group, the data, and the trainer's own modules (they are
        # ~50 MB this profile would not otherwise load).
        importlib.import_module("syncline.train.worker")
        build_dataset(cfg)
        base = _peak_bytes(device)
        model = _layers(build_model_for(cfg)).to(device)
        local = max(1, cfg.batch_size // world)
        sizes = (max(1, local // 8), local) if local >= 2 else (1, 2)
        peaks = _step_peaks(cfg, model, sizes, rank, world)
        costs = _model_costs(cfg, model, sizes, rank, world)
        costs = _with_workspace(costs, sizes, peaks, base)
        other = _other_costs(cfg, model, rank, world)
        # the probes' buffers where the backend communicates for this device (a GPU's memory
        # under NCCL), so the links measured are the run's
        peer = 1 - rank if rank < 2 else None
        p2p = time_ping_pong(P2P_SIZES, peer=peer, device=device) if peer is not None else []
        allreduce = time_allreduce(ALLREDUCE_SIZES, device=device)
        dataset, _ = build_dataset(cfg)
        batch = ShardedBatches(dataset, cfg.batch_size, rank, world, cfg.seed).batch(0)
        x, y = _on(device, batch)
        loss_fn = loss_for(cfg)

        def train_step() -> None:
            model.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()

        grad_bytes = sum(p.numel() * 4 for p in model.parameters())
        alone, shared, comm_s = overlap_slowdown(train_step, grad_bytes, device=device)
        solo = FlatAllreduce(own_group(cfg.timeout_s), timeout_s=cfg.timeout_s)
        compressors = _compressor_costs(model, solo)
        results = comm.gather_objects(
            {
                "costs": costs.to_dict(),
                "other": other,
                "p2p": p2p,
                "allreduce": allreduce,
                "base": base,
                "overlap": (alone, shared, comm_s),
                "compressors": compressors,
                "memory": {
                    "kind": peak_memory_bytes(device).kind,
                    "peak_bytes": max(peak for peak, _ in peaks),
                    "capacity": _capacity(device, world),
                },
            },
            what="gather of profiles",
            timeout_s=cfg.timeout_s,
            device=device,
        )
        if rank == 0 and results is not None:
            _write(Path(args[1]), cfg, results, world, emulated, (device.type, backend))
        comm.barrier(timeout_s=cfg.timeout_s, what="end of profile")
    finally:
        comm.destroy()
    return 0


def _write(
    out: Path,
    cfg: TrainConfig,
    results: list[dict[str, Any]],
    world: int,
    emulated: bool,
    where: tuple[str, str],
) -> None:
    """Rank 0: fit the cluster from every rank's ``results`` and write the profile to
    ``out``; ``where``: the (device type, backend) the ranks were profiled on."""
    from syncline.planner.collectives import ring_allreduce_s

    first = results[0]
    link = _fit_link(P2P_SIZES, first["p2p"]) if first["p2p"] else Link(1e12, 0.0)
    residual = []
    for n, t in zip(ALLREDUCE_SIZES, first["allreduce"], strict=True):
        wire = ring_allreduce_s(n, world, link)
        residual.append(max(t - wire, 0.0) / ((world - 1) / world * n) if world > 1 else 0.0)
    alone, shared, comm_s = (statistics.median(r["overlap"][i] for r in results) for i in range(3))
    overlapped = min(comm_s, shared)
    slowdown = max(shared - alone, 0.0) / overlapped if overlapped > 0 else 0.0
    memory = min(r["memory"]["capacity"] for r in results)
    links = f"emulated {cfg.emulate_network}" if emulated else "loopback"
    device, backend = where
    on = links if device == "cpu" else f"{device}, {backend}"
    cluster = Cluster(
        name=f"this machine ({on})",
        ranks_per_node=1 if emulated else world,
        memory_per_rank=memory,
        intra=link,
        inter=link,
        base_memory=max(r["base"] for r in results),
        step_overhead_s=statistics.median(r["other"]["step_overhead_s"] for r in results),
        compress_s_per_byte={
            k: statistics.median(r["compressors"][k] for r in results) for k in first["compressors"]
        },
        reduce_s_per_byte=statistics.median(residual[-2:]),
        update_s_per_byte=first["other"]["update_s_per_byte"],
        overlap_slowdown=slowdown,
    )
    document = {
        "cluster": cluster.to_dict(),
        "model": first["costs"],
        "measured": {
            "profiled_ranks": world,
            "p2p_sizes": list(P2P_SIZES),
            "p2p_s": first["p2p"],
            "allreduce_sizes": list(ALLREDUCE_SIZES),
            "allreduce_s": first["allreduce"],
            "overlap": {"compute_alone_s": alone, "compute_shared_s": shared, "comm_s": comm_s},
            "device": device,
            "backend": backend,
            "peak_memory_kind": first["memory"]["kind"],
            "peak_memory_bytes_per_rank": [r["memory"]["peak_bytes"] for r in results],
        },
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(document, indent=2) + "\n")
    tmp.replace(out)


if __name__ == "__main__":
    raise SystemExit(main())
