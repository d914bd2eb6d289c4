"""The planner beside two papers: PipeDream-2BW's GPT pipelines and GradientFlow's AlexNet.

Pure computation (no torch, no cluster, a few seconds of one core): each paper's hardware is
written down as a :class:`~syncline.planner.Cluster`, its model as
:class:`~syncline.planner.ModelCosts`, and syncline's planner predicts what the paper
measured. Nothing in syncline is tuned to match; where the prediction disagrees with the paper
the table says so.

- PipeDream-2BW (Narayanan et al., ICML 2021, section 5): GPT models on 8 and 64 V100-16GB,
  at the two batch sizes of each setting. The planner searches depth ``d``, width ``w``,
  micro-batches and recomputation for GPipe, 1F1B-with-flush (PipeDream-Flush) and 2BW, on
  a V100 roofline (:data:`V100`); reported: its 2BW pick, and 2BW over GPipe and Flush at
  corresponding configurations (the same depth and width) and over data parallelism, by
  two rules (each schedule's fastest, and the paper's: recomputation with the largest
  micro-batch that fits), and again on the paper's planner's per-block cost model.
- GradientFlow (Sun et al. 2019, sections 3-4): AlexNet data parallelism on 8..512 V100s over
  56 Gbit/s: an allreduce per layer, lazy allreduce (fused buckets), lazy allreduce plus CSC.

[Note: published, derived, assumed] ``PAPER_2BW`` and ``PAPER_GRADIENTFLOW`` hold only what the
papers print (the 2BW depths from section 5's text; its batch sizes and the speedups over
Flush as recalled for this benchmark from its figures and text, not re-checked against the
PDF). :func:`validation` sets each beside the prediction, in one table. A *derived* figure
is arithmetic on published ones (GradientFlow's images/s). Everything else (link latencies,
model shapes where the paper gives only a parameter count, the search's cap) is an assumption,
named in the docstring of the function that makes it and in ``ASSUMPTIONS``, and saved with
the results; the device's constants carry their sources in ``V100.source``.

[Note: a NIC per node] Both papers' servers share one network port among 8 GPUs, which is
the planner's default (``Cluster.inter_ports_per_node = 1``): a flat ring has one edge
leaving each node, but a hierarchical allreduce's 8 per-rank rings, or the ``w`` replicas of
a pipeline stage sending to the next node at once, share the port. The ``NIC-per-GPU``
figures re-predict with ``inter_ports_per_node = 8`` to show how much that matters.

    python -m benchmarks.planner_papers --out benchmarks/results/planner_papers.json
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.planner_papers.gradientflow import (
    PAPER_GRADIENTFLOW,
    VARIANTS,
    alexnet_costs,
    gradientflow_cluster,
    gradientflow_rows,
    gradientflow_table,
)
from syncline.planner import (
    Affine,
    Cluster,
    Device,
    Link,
    ModelCosts,
    Prediction,
    SearchSpace,
    parse_bandwidth,
    parse_size,
    predict,
    search,
    transformer_costs,
)
from syncline.testing.bench import ratio, write_json

GiB = 2**30
__all__ = [
    "GPT_RUNS",
    "SCHEDULES",
    "alexnet_costs",
    "gpt_row",
    "gradientflow_cluster",
    "gradientflow_rows",
    "main",
    "pipedream_cluster",
]
SCHEDULES = ("gpipe", "1f1b", "2bw")

PAPER_2BW: dict[str, Any] = {
    "hardware": "AWS p3.16xlarge: 8 V100-16GB per server, NVLink inside, 25 Gbit/s between",
    "sequence_length": 512,
    "precision": "mixed (fp16 compute, fp32 master weights and Adam state)",
    "depths": {"gpt-2.2b on 8": 8, "gpt-2.2b on 64": 8, "gpt-3.8b on 64": 16},
    "microbatch_rule": "recomputation, the largest per-GPU micro-batch that fits",
    "speedup_2bw_over_gpipe_up_to": 3.2,
    "speedup_2bw_over_flush_up_to_low_batch": 1.6,
    "order": "2BW > PipeDream-Flush > GPipe",
}
# --- PipeDream-2BW ------------------------------------------------------------------------


V100 = Device(
    "V100-SXM2-16GB",
    peak_flops=125e12,
    memory_bandwidth="900GB",
    efficiency=0.30,
    kernel_s=3.8e-6,
    source=(
        "peak 125 TFLOP/s fp16 tensor cores and 900 GB/s HBM2: NVIDIA Tesla V100 datasheet "
        "(SXM2); efficiency 0.30: Megatron-LM (Shoeybi et al. 2019, section 5) sustains "
        "39 TFLOP/s, 30 % of peak, for a whole GPT on one V100; kernel_s 3.8 us: NVIDIA's "
        "'Getting Started with CUDA Graphs' (Gray 2019) measures short kernels launched back "
        "to back in a stream on a V100 at 3.8 us each (recalled, not re-checked)"
    ),
)
"""The 2BW paper's GPU, as :mod:`syncline.planner.device` prices its kernels."""


def pipedream_cluster() -> Cluster:
    """The 2BW paper's servers: 8 V100-16GB each, NVLink inside, 25 Gbit/s between (published).

    Compute: :data:`V100`, a roofline whose every number names its source. A weight
    version's copy (2BW's STEP) reads and writes each byte once at the datasheet's
    bandwidth. NVLink: 150 GB/s one way per GPU (V100's six NVLink-2 links, 300 GB/s both
    ways; a ring over the hybrid cube mesh gets less). Latencies 5 us inside a server and
    20 us between (the planner's own example values, not measured). Base memory and
    workspace: 0, not modelled (no published figure for this setup), which leaves the
    micro-batches a little more room than the paper's GPUs had.
    """
    return Cluster(
        "p3.16xlarge (2BW)",
        ranks_per_node=8,
        memory_per_rank=parse_size("16GB"),
        intra=Link(parse_bandwidth("1200gbit"), 5e-6),
        inter=Link(parse_bandwidth("25gbit"), 2e-5),
        device=V100,
        update_s_per_byte=2 / V100.memory_bandwidth,
    )


def nic_per_gpu(cluster: Cluster) -> Cluster:
    """``cluster`` with a network port per rank ([Note: a NIC per node])."""
    name = f"{cluster.name}, NIC per GPU"
    return dataclasses.replace(cluster, name=name, inter_ports_per_node=cluster.ranks_per_node)


@dataclass(frozen=True)
class GPTRun:
    """One of the paper's GPT throughput experiments.

    The shapes are assumed (the paper names its models by parameter count): 48 layers of
    width 2560 with 40 heads is the shape of Megatron-LM's 3.9B (BERT) model, standing for
    the paper's 3.8B; the 2.2B one is the same width at 24 layers. syncline's GPT does not
    tie the head to the embedding, so the counts come out 2.15B and 4.04B. The batch sizes
    are the two the paper's throughput figure shows per setting (64 and 256 on 8 GPUs, 512
    and 2048 on 64; recalled, not re-checked against the PDF).
    """

    model: str
    n_layer: int
    n_embd: int
    n_head: int
    ranks: int
    batch_size: int
    paper_depth: int
    """The pipeline depth the paper's planner chose for this model and GPU count (section 5:
    8-deep for 2.2B, 16-deep for 3.8B)."""

    def costs(self, cluster: Cluster) -> ModelCosts:
        return transformer_costs(
            n_layer=self.n_layer,
            n_embd=self.n_embd,
            n_head=self.n_head,
            seq_len=PAPER_2BW["sequence_length"],
            vocab_size=50257,
            flops_per_s=cluster.flops_per_s,
            device=cluster.device,
            name=self.model,
        )


GPT_RUNS = (
    GPTRun("gpt-2.2b", 24, 2560, 40, ranks=8, batch_size=64, paper_depth=8),
    GPTRun("gpt-2.2b", 24, 2560, 40, ranks=8, batch_size=256, paper_depth=8),
    GPTRun("gpt-2.2b", 24, 2560, 40, ranks=64, batch_size=512, paper_depth=8),
    GPTRun("gpt-2.2b", 24, 2560, 40, ranks=64, batch_size=2048, paper_depth=8),
    GPTRun("gpt-3.9b", 48, 2560, 40, ranks=64, batch_size=512, paper_depth=16),
    GPTRun("gpt-3.9b", 48, 2560, 40, ranks=64, batch_size=2048, paper_depth=16),
)
LOW_BATCH = {8: 64, 64: 512}
"""The lower batch size of each GPU count: where the paper states 2BW's lead over Flush."""


def _summary(p: Prediction) -> dict[str, Any]:
    c = p.config
    return {
        "label": c.describe(),
        "depth": c.stages,
        "width": c.width,
        "microbatches": c.microbatches,
        "microbatch_size": c.microbatch_size,
        "recompute": c.recompute,
        "samples_per_s": p.samples_per_s,
        "step_s": p.step_s,
        "peak_gib": p.peak_bytes / GiB,
        "fits": p.fits,
        "bottleneck": p.bottleneck,
        "breakdown_s": p.breakdown,
    }


def _best(ranked: Sequence[Prediction], schedule: str, depth: int | None = None) -> Any:
    """The fastest fitting configuration of ``schedule`` (at ``depth``), or None."""
    fitting = [
        p
        for p in ranked
        if p.fits and p.config.schedule == schedule and depth in (None, p.config.stages)
    ]
    return max(fitting, key=lambda p: p.samples_per_s, default=None)


def _largest(ranked: Sequence[Prediction], schedule: str, depth: int | None = None) -> Any:
    """The paper's rule: with recomputation, the largest micro-batch that fits (then the
    fastest such); over every depth when none is given, the fastest depth."""
    fitting = [
        p
        for p in ranked
        if p.fits
        and p.config.recompute
        and p.config.schedule == schedule
        and depth in (None, p.config.stages)
    ]
    if depth is None:
        depths = {p.config.stages for p in fitting}
        found = [_largest(fitting, schedule, d) for d in depths]
        return max(found, key=lambda p: p.samples_per_s, default=None)
    return max(fitting, key=lambda p: (p.config.microbatch_size, p.samples_per_s), default=None)


def _speedups(ranked: Sequence[Prediction], depth: int, rule: Any = None) -> dict[str, Any]:
    """Each schedule's configuration at one depth (and so one width: the paper's
    "corresponding configurations") chosen by ``rule`` (default the fastest that fits), and
    2BW's speedup over the flush schedules."""
    best = {name: (rule or _best)(ranked, name, depth) for name in SCHEDULES}
    rate = {name: p.samples_per_s for name, p in best.items() if p is not None}
    return {
        "depth": depth,
        "best": {name: _summary(p) for name, p in best.items() if p is not None},
        "2bw_over_gpipe": ratio(rate.get("2bw"), rate.get("gpipe")),
        "2bw_over_flush": ratio(rate.get("2bw"), rate.get("1f1b")),
    }


def blocks_only(costs: ModelCosts) -> ModelCosts:
    """``costs`` as the paper's planner prices a model: per transformer block (section 4:
    it profiles one block and gives each stage ``L/d`` of them), so the head's and the loss's
    compute are left out; their memory stays. A diagnostic, not syncline's model."""
    head = dataclasses.replace(costs.layers[-1], forward=Affine(), backward=Affine())
    return dataclasses.replace(costs, layers=(*costs.layers[:-1], head), loss=Affine())


def _rules(ranked: Sequence[Prediction]) -> dict[str, Any]:
    """The 2BW pick and the corresponding comparisons by each rule."""
    out: dict[str, Any] = {}
    for name, rule in (("fastest", _best), ("paper_rule", _largest)):
        two = rule(ranked, "2bw")
        out[name] = {
            "pick_2bw": None if two is None else _summary(two),
            "corresponding_at_pick": None
            if two is None
            else _speedups(ranked, two.config.stages, rule),
        }
    return out


def gpt_row(run: GPTRun, cluster: Cluster, max_microbatches: int | None = 64) -> dict[str, Any]:
    """The planner on one of the paper's settings: its pick, the best fitting configuration
    of each schedule, 2BW against GPipe and PipeDream-Flush at corresponding configurations
    (the same depth and width: 2BW's pick's, and the paper's), against data parallelism,
    and the best configurations re-predicted with a NIC per GPU.

    Costs are computed, not measured, so throughput alone ranks (``tie=0``)."""
    costs = run.costs(cluster)
    space = SearchSpace(
        ranks=run.ranks,
        batch_size=run.batch_size,
        compressions=("none",),
        schedules=SCHEDULES,
        max_microbatches=max_microbatches,
        tie=0.0,
    )
    ranked = search(space, costs, cluster)
    best = {name: p for name in SCHEDULES if (p := _best(ranked, name)) is not None}
    data_parallel = next(p for p in ranked if p.config.stages == 1)
    two = best.get("2bw")
    ported = nic_per_gpu(cluster)
    rate = {name: p.samples_per_s for name, p in best.items()}
    at_pick = _speedups(ranked, two.config.stages) if two is not None else None
    largest = _largest(ranked, "2bw")
    rule = None if largest is None else _speedups(ranked, largest.config.stages, _largest)
    return {
        "model": run.model,
        "params": costs.params,
        "ranks": run.ranks,
        "batch_size": run.batch_size,
        "candidates": len(ranked),
        "pick": _summary(ranked[0]),
        "pick_2bw": None if two is None else _summary(two),
        "data_parallel": _summary(data_parallel),
        "best_per_schedule": {name: _summary(p) for name, p in best.items()},
        "speedup_2bw_over_gpipe": ratio(rate.get("2bw"), rate.get("gpipe")),
        "speedup_2bw_over_1f1b": ratio(rate.get("2bw"), rate.get("1f1b")),
        "speedup_2bw_over_data_parallel": ratio(
            rate.get("2bw"), data_parallel.samples_per_s if data_parallel.fits else None
        ),
        "corresponding_at_pick": at_pick,
        "corresponding_at_paper_depth": _speedups(ranked, run.paper_depth),
        "paper_rule": {
            "rule": PAPER_2BW["microbatch_rule"] + ", for every schedule",
            "pick_2bw": None if largest is None else _summary(largest),
            "corresponding_at_pick": rule,
        },
        "blocks_only": _rules(search(space, blocks_only(costs), cluster)),
        "nic_per_gpu_samples_per_s": {
            name: predict(costs, ported, p.config).samples_per_s for name, p in best.items()
        },
        "paper_depth": run.paper_depth,
        "paper_width": run.ranks // run.paper_depth,
    }


# --- report -----------------------------------------------------------------------------


def _times(value: float | None) -> str:
    return f"{'-':>10}" if value is None else f"{value:>10.2f}"


def pipedream_table(rows: Sequence[dict[str, Any]]) -> str:
    """Per setting: the 2BW pick, the paper's depth, and 2BW over GPipe and Flush at the
    pick's depth and width (corresponding configurations)."""
    head = (
        f"{'model':<9}{'GPUs':>5}{'batch':>6}  {'2BW pick':<34}{'paper d x w':>12}"
        f"{'2BW/GPipe':>10}{'2BW/Flush':>10}{'2BW/DP':>8}  at the pick's d x w (samples/s)"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        two, at = r["pick_2bw"], r["corresponding_at_pick"] or {}
        best = at.get("best", {})
        pick = "-" if two is None else f"{two['label']} b={two['microbatch_size']}"
        rates = " ".join(f"{n} {best[n]['samples_per_s']:.0f}" for n in SCHEDULES if n in best)
        dp = r["speedup_2bw_over_data_parallel"]
        lines.append(
            f"{r['model']:<9}{r['ranks']:>5}{r['batch_size']:>6}  {pick:<34}"
            f"{r['paper_depth']:>7}x{r['paper_width']:<4}{_times(at.get('2bw_over_gpipe'))}"
            f"{_times(at.get('2bw_over_flush'))}{'  no fit' if dp is None else f'{dp:>8.2f}'}"
            f"  {rates}"
        )
    return "\n".join(lines)


def validation(gpt: Sequence[dict[str, Any]], gf: dict[str, Any]) -> list[dict[str, Any]]:
    """Each published number beside the prediction and its error.

    Depths: the 2BW pick's depth against the paper's (error: predicted / paper). Speedups:
    the paper states maxima ("up to"), so the prediction is the largest over the settings
    (2BW over GPipe: every setting; over Flush: the low batch sizes), at corresponding
    configurations (the 2BW pick's depth and width). Each by two rules: every schedule at its
    fastest fitting configuration, and every schedule by the paper's rule (recomputation,
    the largest micro-batch that fits); and each again on the paper's planner's own cost
    model (:func:`blocks_only`), a diagnostic of where a disagreement comes from.
    GradientFlow: hierarchical lazy allreduce with CSC at 512 GPUs, the paper's system.
    """
    out: list[dict[str, Any]] = []
    low = [r for r in gpt if LOW_BATCH.get(r["ranks"]) == r["batch_size"]]
    for tag, key in (
        ("fastest", None),
        ("paper's rule", "paper_rule"),
        ("blocks only, fastest", "blocks_only/fastest"),
        ("blocks only, paper's rule", "blocks_only/paper_rule"),
    ):

        def get(r: dict[str, Any], key: str | None = key) -> dict[str, Any]:
            for part in (key or "").split("/"):
                r = r[part] if part else r
            return r

        for r in gpt:
            two = get(r)["pick_2bw"]
            depth = None if two is None else two["depth"]
            out.append(
                {
                    "quantity": f"2BW depth ({tag}), {r['model']} on {r['ranks']}, "
                    f"batch {r['batch_size']}",
                    "paper": r["paper_depth"],
                    "predicted": depth,
                    "error": None if depth is None else depth / r["paper_depth"] - 1,
                    "met": depth == r["paper_depth"],
                    "criterion": "the same depth",
                }
            )
        for quantity, paper, name, rows in (
            ("2BW/GPipe up to, same d x w", "speedup_2bw_over_gpipe_up_to", "gpipe", gpt),
            ("2BW/Flush up to, low batch", "speedup_2bw_over_flush_up_to_low_batch", "flush", low),
        ):
            found = [get(r)["corresponding_at_pick"] for r in rows]
            ratios = [x[f"2bw_over_{name}"] for x in found if x and x[f"2bw_over_{name}"]]
            predicted = max(ratios, default=None)
            stated = PAPER_2BW[paper]
            out.append(
                {
                    "quantity": f"{quantity} ({tag})",
                    "paper": stated,
                    "predicted": predicted,
                    "error": None if predicted is None else predicted / stated - 1,
                    "met": predicted is not None and stated / 1.5 <= predicted <= stated * 1.5,
                    "criterion": "within 1.5x",
                }
            )
    top = max(r["ranks"] for r in gf["rows"])
    row = next(
        r
        for r in gf["rows"]
        if r["ranks"] == top and r["allreduce"] == "hierarchical" and r["variant"] == "lazy+csc"
    )
    speedup = row["samples_per_s"] / gf["single_gpu_samples_per_s"]
    for quantity, paper, predicted in (
        (
            f"GradientFlow minutes, 95 epochs on {top} GPUs",
            PAPER_GRADIENTFLOW["minutes"],
            row["minutes_95_epochs"],
        ),
        (f"GradientFlow speedup on {top} GPUs", PAPER_GRADIENTFLOW["speedup_512"], speedup),
    ):
        error = predicted / paper - 1
        out.append(
            {
                "quantity": quantity,
                "paper": paper,
                "predicted": predicted,
                "error": error,
                "met": abs(error) <= 0.15,
                "criterion": "within 15 %",
            }
        )
    return out


def validation_table(rows: Sequence[dict[str, Any]]) -> str:
    head = f"{'published number':<62}{'paper':>8}{'predicted':>11}{'error':>9}  met"
    lines = [head, "-" * len(head)]
    for r in rows:
        pred = "-" if r["predicted"] is None else f"{r['predicted']:.4g}"
        err = "-" if r["error"] is None else f"{r['error']:+.0%}"
        lines.append(
            f"{r['quantity']:<62}{r['paper']:>8.4g}{pred:>11}{err:>9}  "
            f"{'yes' if r['met'] else 'NO'}"
        )
    return "\n".join(lines)


ASSUMPTIONS = {
    "device": "V100 roofline: see cluster.device.source",
    "model_shapes": "2.2B: 24 x 2560, 40 heads; 3.8B: 48 x 2560, 40 heads (untied head)",
    "batch_sizes": "64/256 on 8 GPUs, 512/2048 on 64 (the paper's figure, recalled)",
    "max_microbatches": "a cap on the micro-batches searched, for search time",
    "tie": "0: computed costs carry no measurement error, throughput alone ranks",
    "placement": "a stage's replicas on one server; one 25 Gbit/s port per server",
    "base_memory_and_workspace": "0: not modelled, no published figure for this setup",
    "gradientflow_single_gpu": "the paper's 512-GPU rate over its 410x",
    "gradientflow_per_gpu_batch": 128,
    "gradientflow_layer_times": "AlexNet's multiply-adds share of the single-GPU time",
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.planner_papers", description=__doc__)
    ap.add_argument("--max-microbatches", type=int, default=64, help="0: no cap")
    ap.add_argument("--gf-ranks", default="8,16,32,64,128,256,512")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    cap = a.max_microbatches or None
    cluster = pipedream_cluster()
    gpt = [gpt_row(run, cluster, cap) for run in GPT_RUNS]
    gf = gradientflow_rows([int(n) for n in a.gf_ranks.split(",")])
    checks = validation(gpt, gf)
    print(pipedream_table(gpt))
    print()
    print(gradientflow_table(gf))
    print()
    print(validation_table(checks))
    doc = {
        "validation": checks,
        "assumptions": {**ASSUMPTIONS, "max_microbatches": cap},
        "pipedream_2bw": {
            "paper": PAPER_2BW,
            "cluster": cluster.to_dict(),
            "max_microbatches": cap,
            "rows": gpt,
        },
        "gradientflow": {
            "paper": PAPER_GRADIENTFLOW,
            "cluster": gradientflow_cluster().to_dict(),
            "variants": VARIANTS,
            **gf,
        },
    }
    if a.out is not None:
        write_json(a.out, doc, indent=2)
    return 0
