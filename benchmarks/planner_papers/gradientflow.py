"""GradientFlow (Sun et al. 2019, sections 3-4) through the planner: AlexNet data parallelism
on 8..512 V100s over 56 Gbit/s: an allreduce per layer, lazy allreduce (fused buckets), lazy
allreduce plus CSC; flat and hierarchical. Part of ``python -m benchmarks.planner_papers``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from syncline.planner import (
    Affine,
    Cluster,
    Configuration,
    LayerCost,
    Link,
    ModelCosts,
    parse_bandwidth,
    parse_size,
    predict,
)

IMAGENET_TRAIN_IMAGES = 1_281_167

PAPER_GRADIENTFLOW: dict[str, Any] = {
    "gpus": 512,
    "gpus_per_server": 8,
    "network_gbit": 56,
    "epochs": 95,
    "minutes": 1.5,
    "speedup_512": 410,
    "baseline_speedup_64": 2.5,  # off-the-shelf systems, the paper's motivation
}


def _derived_gradientflow() -> dict[str, float]:
    """Images/s at 512 GPUs (95 epochs in 1.5 minutes), and on one GPU (that over 410)."""
    p = PAPER_GRADIENTFLOW
    at_512 = p["epochs"] * IMAGENET_TRAIN_IMAGES / (p["minutes"] * 60)
    return {
        "images_per_s_512": at_512,
        "images_per_s_1": at_512 / p["speedup_512"],
        "efficiency_512": p["speedup_512"] / p["gpus"],
    }


# --- GradientFlow ---------------------------------------------------------------------------

# torchvision's AlexNet: (layer, forward multiply-adds per 224x224 image, parameters, outputs)
ALEXNET = (
    ("conv1", 70.3e6, 23_296, 64 * 55 * 55),
    ("conv2", 223.9e6, 307_392, 192 * 27 * 27),
    ("conv3", 112.1e6, 663_936, 384 * 13 * 13),
    ("conv4", 149.5e6, 884_992, 256 * 13 * 13),
    ("conv5", 99.7e6, 590_080, 256 * 13 * 13),
    ("fc6", 37.7e6, 37_752_832, 4096),
    ("fc7", 16.8e6, 16_781_312, 4096),
    ("fc8", 4.1e6, 4_097_000, 1000),
)


def alexnet_costs(images_per_s: float) -> ModelCosts:
    """AlexNet (61.1M parameters) at ``images_per_s`` on one GPU, fp16 gradients.

    Assumed: a layer's time is its share of the multiply-adds (fully connected layers are
    in truth memory-bound, so this moves some time from them to the convolutions), backward
    twice forward, activations 2 fp16 values per output kept.
    """
    total = sum(macs for _, macs, _, _ in ALEXNET)
    per_image = 1.0 / images_per_s
    layers = tuple(
        LayerCost(
            name,
            Affine(0.0, per_image / 3 * macs / total),
            Affine(0.0, per_image * 2 / 3 * macs / total),
            params,
            activation_bytes=4.0 * outputs,
            output_bytes=2.0 * outputs,
        )
        for name, macs, params, outputs in ALEXNET
    )
    return ModelCosts("alexnet", layers, input_bytes=3 * 224 * 224 * 2.0, param_bytes=2)


def gradientflow_cluster() -> Cluster:
    """8 V100s per server (published), 56 Gbit/s between servers (published).

    Assumed: NVLink as in :func:`pipedream_cluster`; 5 us a message inside a server and
    10 us between (InfiniBand-class, not measured); memory 16 GB (AlexNet fits anyway).
    """
    return Cluster(
        "GradientFlow V100 x8",
        ranks_per_node=8,
        memory_per_rank=parse_size("16GB"),
        intra=Link(parse_bandwidth("1200gbit"), 5e-6),
        inter=Link(parse_bandwidth(f"{PAPER_GRADIENTFLOW['network_gbit']}gbit"), 1e-5),
    )


LAZY_CAP_MB = 64.0  # Horovod's fusion threshold; the paper's own threshold is not used here
VARIANTS: dict[str, dict[str, Any]] = {
    "per-layer": {"bucket_cap_mb": 1e-6, "first_bucket_cap_mb": 1e-6},
    "lazy": {"bucket_cap_mb": LAZY_CAP_MB, "first_bucket_cap_mb": LAZY_CAP_MB},
    "lazy+csc": {
        "bucket_cap_mb": LAZY_CAP_MB,
        "first_bucket_cap_mb": LAZY_CAP_MB,
        "compression": "csc:0.01",
    },
}
"""Per layer: an allreduce as each layer's gradient is ready. Lazy: fused into 64 MiB
buckets. CSC: syncline's default density (1 %) and chunk (32768 elements)."""


def gradientflow_rows(ranks: Sequence[int], per_gpu_batch: int = 128) -> dict[str, Any]:
    """Samples/s and scaling efficiency per rank count and variant: flat ring allreduce (the
    paper's), and hierarchical, both over one NIC per node ([Note: a NIC per node]).

    Assumed: ``per_gpu_batch`` images per GPU (64K at 512 GPUs), SGD, no step overhead.
    """
    derived = _derived_gradientflow()
    costs = alexnet_costs(derived["images_per_s_1"])
    flat = gradientflow_cluster()
    single = predict(costs, flat, Configuration(1, per_gpu_batch, optimizer="sgd"))
    rows = []
    for n in ranks:
        for algorithm, cluster in (("flat", flat), ("hierarchical", flat)):
            for variant, options in VARIANTS.items():
                config = Configuration(
                    n, n * per_gpu_batch, optimizer="sgd", allreduce=algorithm, **options
                )
                p = predict(costs, cluster, config)
                rows.append(
                    {
                        "ranks": n,
                        "allreduce": algorithm,
                        "variant": variant,
                        "samples_per_s": p.samples_per_s,
                        "efficiency": p.samples_per_s / (n * single.samples_per_s),
                        "exposed_allreduce_s": p.breakdown["allreduce"],
                        "step_s": p.step_s,
                        "minutes_95_epochs": 95 * IMAGENET_TRAIN_IMAGES / p.samples_per_s / 60,
                    }
                )
    return {
        "params": costs.params,
        "per_gpu_batch": per_gpu_batch,
        "single_gpu_samples_per_s": single.samples_per_s,
        "derived_from_paper": derived,
        "rows": rows,
    }


def gradientflow_table(doc: dict[str, Any]) -> str:
    by = {(r["ranks"], r["allreduce"], r["variant"]): r for r in doc["rows"]}
    ranks = sorted({r["ranks"] for r in doc["rows"]})
    cols = [("flat", v) for v in VARIANTS] + [("hierarchical", v) for v in VARIANTS]
    head = f"{'GPUs':>5}" + "".join(
        f"{('hier ' if a == 'hierarchical' else '') + v:>16}" for a, v in cols
    )
    paper = PAPER_GRADIENTFLOW
    derived = doc["derived_from_paper"]
    lines = ["scaling efficiency (images/s in thousands)", head, "-" * len(head)]
    for n in ranks:
        cells = "".join(
            f"{by[n, a, v]['efficiency']:>9.0%} ({by[n, a, v]['samples_per_s'] / 1e3:>4.0f})"
            for a, v in cols
        )
        lines.append(f"{n:>5}{cells}")
    lines.append(
        f"paper: {paper['speedup_512'] / paper['gpus']:.0%} at 512 GPUs "
        f"({derived['images_per_s_512'] / 1e3:.0f}k images/s, {paper['minutes']} min for "
        f"{paper['epochs']} epochs); off-the-shelf {paper['baseline_speedup_64']}x at 64 GPUs"
    )
    top = by[max(ranks), "flat", "lazy+csc"]
    lines.append(f"ours, flat lazy+csc at {max(ranks)}: {top['minutes_95_epochs']:.1f} min")
    return "\n".join(lines)
