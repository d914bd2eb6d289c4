"""Does CSC send its density of the gradient? Bytes on the wire per step, measured by
``syncline train`` (2 ranks, its own processes, the default GPT), against the density.

CSC (GradientFlow's coarse-grained sparse communication) sends ``density`` of the gradient's
chunks per step over the whole gradient, not per bucket: each bucket's share
``density * chunks`` is added to the fraction it carried from earlier steps and rounded
down (:meth:`syncline.dp.compressors.csc.CSC._budget`). Per rank and bucket of ``N`` chunks
the wire carries ``4 * (N + 1)`` bytes of chunk scores and bound, then the selected chunks
in fp16 (2 bytes an element); ``momentum=0`` beside the default AdamW. This reads each
step's ``wire_bytes`` from ``metrics.jsonl``, leaves out the first step (the engine's
dense fp32 allreduce, before CSC runs), takes the scores off, and reports the chunks sent
(payload bytes / (2 * chunk)) against ``density x chunks`` over the run.

The floor (issue 15): the chunks due by the credit rule total ``density x chunks`` within
one chunk per bucket, and every step sends exactly its due chunks, less only what the
buckets' short last chunks lack of a whole chunk (a short chunk is scored as if full, so it
is chosen on its values, and then sends what it has).

    python -m benchmarks.csc_density --out benchmarks/results/csc_density.json
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

from syncline.testing.bench import write_json

CHUNK = 32768  # the chunk this benchmark fixes (CSC derives one per bucket unless told)
FP16 = 2


def run(density: float, steps: int, work: Path, model: list[str]) -> dict[str, Any]:
    run_dir = work / f"csc-{density:g}"
    spec = f"csc:{density}:warmup=0:momentum=0:chunk={CHUNK}"  # chunks fixed: bytes -> chunks
    args = ["train", *model, f"--compression={spec}", f"--steps={steps}"]
    args += ["--log-every=1", "--checkpoint-every=0", "--eval-every=0", f"--run-dir={run_dir}"]
    res = subprocess.run([sys.executable, "-m", "syncline.cli.main", *args],
                         capture_output=True, text=True, timeout=1800, check=False)  # fmt: skip
    if res.returncode:
        raise SystemExit(f"syncline train failed:\n{res.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    wire = [int(r["wire_bytes"]) for r in records]
    numels: list[int] = summary["bucket_numels"]
    chunks = [math.ceil(n / CHUNK) for n in numels]
    # scores + bound of every bucket with a chunk due; a bucket due nothing sends nothing
    # (at these densities every bucket of the default GPT is due at some steps only), so
    # the scores are counted from the same credit rule CSC uses
    credit = [0.0] * len(numels)
    sent, due_total, at_density, scores_total = 0.0, 0, 0.0, 0
    per_step = []
    # the engine's first step is a plain fp32 allreduce (it learns the buckets' order), so
    # CSC first runs at step 1: its credit starts there
    first, wire = wire[0], wire[1:]
    for w in wire:
        scores = due = 0
        for b, n in enumerate(chunks):
            total = credit[b] + density * n
            k = min(n, math.floor(total * (1.0 + 1e-12)))
            credit[b] = max(total - k, 0.0)
            if k:
                scores += 4 * (n + 1)
                due += k
        scores_total += scores
        step_chunks = (w - scores) / (FP16 * CHUNK)
        sent += step_chunks
        due_total += due
        at_density += density * sum(chunks)
        per_step.append({"wire_bytes": w, "chunks_sent": step_chunks, "chunks_due": due})
    # a step sends its due chunks, less what the short last chunks of the buckets lack
    short = [n * CHUNK - m for n, m in zip(chunks, numels, strict=True)]
    per_step_ok = all(
        -1e-9 <= r["chunks_due"] - r["chunks_sent"] <= sum(short) / CHUNK + 1e-9 for r in per_step
    )
    return {
        "density": density,
        "steps": steps,
        "parameters": summary["parameters"],
        "bucket_numels": numels,
        "chunks": sum(chunks),
        "first_step_wire_bytes": first,
        "wire_bytes_per_step_mean": sum(wire) / len(wire),
        "dense_fp32_bytes_per_step": summary["gradient_bytes"],
        "fraction_of_dense_fp32": sum(wire) / len(wire) / summary["gradient_bytes"],
        "chunks_sent_total": sent,
        "chunks_due_total": due_total,
        "chunks_at_density_total": at_density,
        "due_minus_density_chunks": due_total - at_density,
        "sent_minus_density_chunks": sent - at_density,
        "every_step_sends_its_due_chunks": per_step_ok,
        "bytes_per_step_at_density": FP16 * CHUNK * density * sum(chunks),
        "scores_bytes_total": scores_total,
        "final_loss": summary["final_loss"],
        "per_step": per_step,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.csc_density", description=__doc__)
    ap.add_argument("--densities", default="0.001,0.01,0.1")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--work", type=Path, default=Path("runs/bench-csc-density"))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("model", nargs="*", default=["--model=gpt"], help="syncline train options")
    a = ap.parse_args(argv)
    rows = []
    for density in (float(x) for x in a.densities.split(",")):
        row = run(density, a.steps, a.work, a.model)
        rows.append(row)
        print(f"density {density:g}: {row['chunks']} chunks of {CHUNK} in "
              f"{len(row['bucket_numels'])} buckets; over {a.steps} steps sent "
              f"{row['chunks_due_total']} chunks ({row['chunks_sent_total']:.2f} by bytes, short "
              f"last chunks), density x chunks = {row['chunks_at_density_total']:.2f}; "
              f"{row['wire_bytes_per_step_mean']:.0f} B/step = "
              f"{row['fraction_of_dense_fp32']:.3%} of dense fp32", flush=True)  # fmt: skip
    ok = all(
        abs(r["due_minus_density_chunks"]) < len(r["bucket_numels"])
        and r["every_step_sends_its_due_chunks"]
        for r in rows
    )
    result = {"chunk_elems": CHUNK, "rows": rows, "floor_within_one_chunk": ok}
    if a.out is not None:
        write_json(a.out, result, indent=2)
    return 0
