"""Large batches: does the recipe (LAMB/LARS, warm-up, scaling rule) keep them converging?

Each run is ``syncline train`` (2 ranks, its own processes), so what is measured is what a
user gets. For a model, every run sees the same number of samples: the base batch for
``--base-steps`` steps, and batches 8x and 32x as large for 8x and 32x fewer steps. Two
recipes at each large batch:

- ``naive``: the base optimizer (AdamW for the GPT, momentum SGD for the CNN), the learning
  rate scaled linearly with the batch, no warm-up;
- ``recipe``: LAMB (GPT) or LARS (CNN), the square-root (LAMB) or linear (LARS) scaling
  rule, and a warm-up of ``--warmup-fraction`` of the steps (Goyal et al. 2017; You et al.
  2017, 2019).

The recipe's own base learning rate (LAMB's and LARS's are relative: the fraction of each
tensor's norm a step may move, not AdamW's or SGD's absolute step) is tuned with
``--recipe-lrs``: each value is run at every large batch and the best final held-out loss is
reported as the recipe, every value's run kept under ``sweep`` in the JSON. The naive setting
is not tuned: it is the base run's learning rate scaled linearly, as a user would first try.

Reported per run: the held-out loss at the end (the same held-out batches for every run),
the gap to the base batch's, the resolved peak learning rate, and the wall time; a plot of
validation loss against samples seen goes next to the JSON.

    python -m benchmarks.large_batch --out benchmarks/results/large_batch.json

Floor (issue 15): the recipe within 2 % of the base batch's final held-out loss at 8x.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from syncline.testing.bench import write_json

#: model -> (model options, base optimizer and lr, recipe optimizer, its scaling rule, lr)
MODELS: dict[str, dict[str, Any]] = {
    "gpt": {
        "args": ["--model", "gpt"],
        "base": {"optimizer": "adamw", "lr": 3e-3},
        "naive": {"optimizer": "adamw", "lr": 3e-3, "scaling": "linear"},
        "recipe": {"optimizer": "lamb", "lr": 3e-3, "scaling": "sqrt"},
    },
    "cnn": {
        "args": ["--model", "cnn", "--data", "digits"],
        "base": {"optimizer": "sgd", "lr": 0.05},
        "naive": {"optimizer": "sgd", "lr": 0.05, "scaling": "linear"},
        "recipe": {"optimizer": "lars", "lr": 0.05, "scaling": "linear"},
    },
}


def _run(model: str, name: str, batch: int, steps: int, recipe: dict[str, Any],
         warmup: int, a: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    run_dir = a.work / f"{model}-{name}-{batch}"
    args = [*MODELS[model]["args"], f"--batch-size={batch}", f"--steps={steps}"]
    args += [f"--optimizer={recipe['optimizer']}", f"--lr={recipe['lr']}"]
    args += [f"--warmup-steps={warmup}", f"--base-batch-size={a.base_batch}"]
    args += [f"--lr-scaling={recipe.get('scaling', 'none')}", f"--seed={a.seed}"]
    if "weight_decay" in recipe:  # only when set, so earlier runs' arguments stay reusable
        args += [f"--weight-decay={recipe['weight_decay']}"]
    args += [f"--eval-every={max(1, steps // 8)}", "--checkpoint-every=0"]
    args += [f"--log-every={max(1, steps // 20)}", f"--run-dir={run_dir}"]
    key = [x for x in args if not x.startswith("--run-dir=")]
    for old in a.reused:
        if [x for x in old.get("args", []) if not x.startswith("--run-dir=")] == key:
            print(f"  {model} {name:6s} batch {batch:5d}: reused from {a.reuse}", flush=True)
            return dict(old, reused_from=str(a.reuse))
    cmd = [sys.executable, "-m", "syncline.cli.main", "train", *args]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, check=False)
    wall = time.perf_counter() - t0
    if res.returncode:
        return {"error": res.stderr[-2000:], "args": args}
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    curve = [(r["step"] + 1) * batch for r in records if r["val_loss"] is not None]
    vals = [r["val_loss"] for r in records if r["val_loss"] is not None]
    print(f"  {model} {name:6s} batch {batch:5d} x {steps:4d} steps: val "
          f"{summary['final_val_loss']:.4f} (lr {summary['peak_lr']:.4g}, {wall:.0f}s)",
          flush=True)  # fmt: skip
    return {
        "batch": batch,
        "steps": steps,
        "args": args,
        "final_val_loss": summary["final_val_loss"],
        "best_val_loss": summary["best_val_loss"],
        "final_loss": summary["final_loss"],
        "peak_lr": summary["peak_lr"],
        "wall_s": wall,
        "val_curve": {"samples": curve, "val_loss": vals},
    }


def _earlier_runs(path: Path) -> list[dict[str, Any]]:
    """Every run recorded in an earlier result (the chosen ones and every sweep point)."""
    old = json.loads(path.read_text())
    runs: list[dict[str, Any]] = []
    for model in old.get("models", {}).values():
        runs += [r for r in model.get("runs", {}).values() if "final_val_loss" in r]
        for tried in model.get("sweep", {}).values():
            runs += [r for r in tried if "final_val_loss" in r]
    return runs


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(result["models"])
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), dpi=100)
    for ax, model in zip([axes] if len(models) == 1 else axes, models, strict=True):
        for label, run in result["models"][model]["runs"].items():
            if "val_curve" in run:
                c = run["val_curve"]
                ax.plot(c["samples"], c["val_loss"], "o-", ms=3, label=label)
        ax.set_xlabel("samples seen")
        ax.set_ylabel("validation loss")
        ax.set_title(f"{model}: base batch {result['base_batch']}, same samples")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.large_batch", description=__doc__)
    ap.add_argument("--models", default="gpt,cnn")
    ap.add_argument("--base-batch", type=int, default=32)
    ap.add_argument("--base-steps", type=int, default=640)
    ap.add_argument("--factors", default="8,32")
    ap.add_argument("--warmup-fraction", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--recipe-lrs", default=None, help="recipe base lrs to try, e.g. 0.01,0.02")
    ap.add_argument(
        "--recipe-weight-decay", type=float, default=None,
        help="decoupled weight decay for the recipe's optimizer (LAMB/LARS; default: none)",
    )  # fmt: skip
    ap.add_argument(
        "--no-naive", action="store_true",
        help="train only the base and the recipe (e.g. a follow-up sweep of the recipe)",
    )  # fmt: skip
    ap.add_argument("--work", type=Path, default=Path("runs/bench-large-batch"))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--reuse", type=Path, default=None,
        help="an earlier result JSON: a run with the same arguments (all but --run-dir) is "
        "taken from it instead of trained again, and marked reused_from",
    )  # fmt: skip
    a = ap.parse_args(argv)
    a.reused = _earlier_runs(a.reuse) if a.reuse else []
    factors = [int(f) for f in a.factors.split(",")]
    result: dict[str, Any] = {"base_batch": a.base_batch, "base_steps": a.base_steps,
                              "warmup_fraction": a.warmup_fraction, "models": {}}  # fmt: skip
    for model in a.models.split(","):
        spec = MODELS[model]
        runs: dict[str, Any] = {}
        sweeps: dict[str, list[dict[str, Any]]] = {}
        base_warmup = max(1, int(a.warmup_fraction * a.base_steps))
        entry: dict[str, Any] = {"runs": runs, "gap_to_base": {}, "sweep": sweeps}
        result["models"][model] = entry
        runs["base"] = _run(model, "base", a.base_batch, a.base_steps, spec["base"], base_warmup, a)
        _save_partial(result, a)
        for f in factors:
            steps = max(1, a.base_steps // f)
            batch = a.base_batch * f
            # The recipe first: it carries the floor, and a long run stopped part-way keeps it.
            warmup = max(1, int(a.warmup_fraction * steps))
            lrs = [float(x) for x in a.recipe_lrs.split(",")] if a.recipe_lrs else [None]
            tried: list[dict[str, Any]] = []
            for lr in lrs:
                recipe = dict(spec["recipe"], **({"lr": lr} if lr is not None else {}))
                if a.recipe_weight_decay is not None:
                    recipe["weight_decay"] = a.recipe_weight_decay
                name = "recipe" if lr is None else f"recipe-lr{lr:g}"
                if a.recipe_weight_decay is not None:
                    name += f"-wd{a.recipe_weight_decay:g}"
                tried.append(_run(model, name, batch, steps, recipe, warmup, a))
                ok = [r for r in tried if "final_val_loss" in r] or tried
                runs[f"recipe x{f}"] = min(ok, key=lambda r: r.get("final_val_loss", 1e30))
                if len(lrs) > 1:
                    sweeps[f"recipe x{f}"] = tried
                _save_partial(result, a)
            if not a.no_naive:
                runs[f"naive x{f}"] = _run(model, "naive", batch, steps, spec["naive"], 0, a)
                _save_partial(result, a)
        entry["gap_to_base"] = gaps = _gaps(runs)
        print(f"{model}: gaps to the base batch's final held-out loss: "
              + ", ".join(f"{k} {v:+.1%}" for k, v in gaps.items()), flush=True)  # fmt: skip
    if a.out is not None:
        result.pop("partial", None)
        write_json(a.out, result, indent=2)
        _plot(result, a.out.with_suffix(".png"))
    return 0


def _gaps(runs: dict[str, Any]) -> dict[str, float]:
    """Each run's final held-out loss relative to the base batch's (+0.02 is 2 % worse)."""
    base = runs.get("base", {}).get("final_val_loss")
    return {
        label: run["final_val_loss"] / base - 1.0
        for label, run in runs.items()
        if label != "base" and "final_val_loss" in run and base
    }


def _save_partial(result: dict[str, Any], a: argparse.Namespace) -> None:
    """Write what has finished so far, marked ``partial``.

    A sweep at long training lengths runs for hours; if it is stopped, the finished runs stay
    in ``--out`` and a rerun with ``--reuse`` of that file trains only what is missing.
    """
    if a.out is None:
        return
    for entry in result["models"].values():
        entry["gap_to_base"] = _gaps(entry["runs"])
    write_json(a.out, dict(result, partial=True), indent=2)
