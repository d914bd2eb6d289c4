"""lowbw's engines: every configuration's model, data-parallel wrapper, optimizer and batches.

Every configuration trains the same byte-level GPT from the same initialisation on the same
batches, with SGD; only the data-parallel engine and its gradient compression differ. Each
engine comes with a ``wire_bytes(step)`` function: what this rank sent in that step (payload,
before the ring's 2(p-1)/p).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from syncline import DataParallel
from syncline.data import ByteDataset, ShardedBatches, stdlib_corpus
from syncline.dp.compression import NoCompression
from syncline.dp.compressors import BF16, CSC, FP16, PowerSGD, TopK
from syncline.dp.compressors import chunks as ch
from syncline.models import build_model, lm_loss

SYNCLINE_CONFIGS = ("none", "fp16", "bf16", "csc", "topk", "powersgd")
#: the compute-only bound: the same model and steps with no synchronisation at all
#: (DataParallel under ``no_sync()``: nothing on the wire); not a way to train
BOUND = "nosync"
DDP_CONFIGS = ("ddp", "ddp-fp16", "ddp-powersgd")
CONFIGS = SYNCLINE_CONFIGS + DDP_CONFIGS + (BOUND,)

WireBytes = Callable[[int], int]


def _powersgd_hook_numel(model: Any, rank: int, min_rate: float = 2.0) -> int:
    """Elements the DDP PowerSGD hook sends per step once compressing: per parameter, P and Q
    (``n*r + m*r`` for its ``n x m`` view) when ``(n+m)*r*min_rate < n*m``, else the tensor."""
    total = 0
    for p in model.parameters():
        n = p.shape[0] if p.dim() > 0 else 1
        m = p.numel() // n
        r = min(n, m, rank)
        total += (n + m) * r if (n + m) * r * min_rate < n * m else p.numel()
    return total


def gpt_numel(s: dict[str, Any]) -> int:
    """Parameters of the GPT that settings ``s`` describe."""
    shape = {k: s[k] for k in ("n_layer", "n_embd", "n_head", "block_size")}
    return sum(p.numel() for p in build_model("gpt", **shape).parameters())


def _ddp_engine(name: str, model: Any, s: dict[str, Any]) -> tuple[Any, WireBytes, dict[str, Any]]:
    """torch DDP, plain or with its fp16 / PowerSGD comm hook; wire bytes computed."""
    n_params = sum(p.numel() for p in model.parameters())
    info: dict[str, Any] = {}
    ddp = DDP(model, bucket_cap_mb=s["bucket_cap_mb"])
    if name == "ddp":
        return ddp, lambda step: 4 * n_params, info
    if name == "ddp-fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return ddp, lambda step: 2 * n_params, info
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    start = max(2, s["warmup_steps"])  # DDP refuses < 2 with error feedback / warm start
    state = psgd.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=s["powersgd_rank"],
        start_powerSGD_iter=start,
    )
    ddp.register_comm_hook(state, psgd.powerSGD_hook)
    analytic = 4 * _powersgd_hook_numel(model, s["powersgd_rank"], state.min_compression_rate)
    info.update(start_powerSGD_iter=start, analytic_compressed_bytes=analytic)
    seen = {"total": 0}

    def psgd_bytes(step: int) -> int:
        total = int(state.total_numel_after_compression)  # the hook's own counter
        delta, seen["total"] = total - seen["total"], total
        return 4 * n_params if step < start else 4 * delta

    return ddp, psgd_bytes, info


def build_engine(name: str, model: Any, s: dict[str, Any]) -> tuple[Any, WireBytes, dict[str, Any]]:
    """(engine, wire_bytes(step) -> int, info) for configuration ``name``."""
    if name in DDP_CONFIGS:
        return _ddp_engine(name, model, s)
    warm = s["warmup_steps"]
    info: dict[str, Any] = {}
    if name == BOUND:
        dp = DataParallel(model, bucket_cap_mb=s["bucket_cap_mb"])
        return dp, lambda step: 0, {"no_sync": True}
    comp = {
        "none": lambda: NoCompression(),
        "fp16": lambda: FP16(),
        "bf16": lambda: BF16(),
        "csc": lambda: CSC(
            s["density"], chunk_elems=s["chunk_elems"], warmup_steps=warm, momentum=s["momentum"]
        ),
        "topk": lambda: TopK(s["topk_ratio"]),
        "powersgd": lambda: PowerSGD(rank=s["powersgd_rank"], warmup_steps=warm),
    }[name]()
    dp = DataParallel(model, compression=comp, bucket_cap_mb=s["bucket_cap_mb"])
    if name == "csc":
        buckets = [b.end - b.start for b in dp.bucket_plan.buckets]
        n_chunks = [ch.num_chunks(n, s["chunk_elems"]) for n in buckets]
        sent = [ch.chunks_to_send(s["density"], c) for c in n_chunks]
        info.update(
            chunk_elems=s["chunk_elems"],
            bucket_numel=buckets,
            chunks_per_bucket=n_chunks,
            chunks_total=sum(n_chunks),
            chunks_sent_per_step=sum(sent),
            elements_sent_per_step_max=sum(k * s["chunk_elems"] for k in sent),
        )
    return dp, lambda step: int(dp.last_stats.wire_bytes), info


@dataclass
class Run:
    """One configuration on one rank: what a training step needs, and how far it got."""

    engine: Any
    wire: WireBytes
    info: dict[str, Any]
    opt: torch.optim.Optimizer
    batches: ShardedBatches
    n_params: int
    opt_momentum: float
    step: int = 0


def setup(rank: int, world: int, s: dict[str, Any], name: str) -> Run:
    """Model (same init on every rank and config), engine, optimizer and this rank's batches."""
    torch.manual_seed(s["seed"])
    model = build_model(
        "gpt",
        n_layer=s["n_layer"],
        n_embd=s["n_embd"],
        n_head=s["n_head"],
        block_size=s["block_size"],
    )
    n_params = sum(p.numel() for p in model.parameters())
    engine, wire, info = build_engine(name, model, s)
    # CSC applies the momentum itself (momentum correction): the optimizer must not.
    momentum = 0.0 if name == "csc" else s["momentum"]
    opt = torch.optim.SGD(engine.parameters(), lr=s["lr"], momentum=momentum)
    data = ByteDataset(stdlib_corpus(s["corpus_bytes"]), s["block_size"])
    batches = ShardedBatches(data, s["global_batch"], rank, world, s["seed"])
    return Run(engine, wire, info, opt, batches, n_params, momentum)


def exposed_comm_s(run: Run) -> float | None:
    """Seconds the last step waited for communication after backward (DataParallel's
    ``last_stats``); None for DDP, which does not report it, and for the no-sync bound."""
    if run.info.get("no_sync") or not isinstance(run.engine, DataParallel):
        return None
    return float(run.engine.last_stats.exposed_comm_s)


def train_step(run: Run) -> tuple[float, int]:
    """One training step; returns (local loss, wire bytes this rank sent)."""
    step = run.step
    x, y = run.batches.batch(step)
    run.opt.zero_grad(set_to_none=True)
    if run.info.get("no_sync"):
        with run.engine.no_sync():
            loss = lm_loss(run.engine(x), y)
            loss.backward()
    else:
        loss = lm_loss(run.engine(x), y)
        loss.backward()
    run.opt.step()
    run.step = step + 1
    return loss.item(), run.wire(step)
