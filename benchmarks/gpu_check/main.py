"""scripts/gpu_check.sh: one command that checks syncline on a GPU, or on the CPU (CI).

``--device cpu`` runs the same checks on the CPU with gloo, as CI does.

Each check is a function ``check(device) -> record`` (``ok`` and its figures) and runs in a
fresh interpreter of its own under a time limit, so a crash or a hang in one costs only that
one: the runner records it as failed (with the end of its output) and goes on. The JSON (each
check ``{name, ok, seconds, ...}``, and the device name, torch, CUDA and NCCL versions) is
rewritten after every check, so even an interrupted run leaves what it measured; the exit
code is 1 when any check failed.

    scripts/gpu_check.sh                     # -> benchmarks/results/gpu_check.json
    scripts/gpu_check.sh --device cpu        # -> benchmarks/results/gpu_check_cpu.json
    scripts/gpu_check.sh --checks train,compressors --out /tmp/check.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.gpu_check.common import DEVICES, Record, environment, run_bounded, tail
from syncline.testing.bench import write_json

#: name -> (module:function, time limit in seconds on cuda, on cpu), in the order they run.
#: Each limit is above the sum of the check's own inner limits (its ranks' runs, its
#: launches), so a stuck rank is reported by the check, naming it, before the runner kills it.
CHECKS: dict[str, tuple[str, int, int]] = {
    "train": ("train_cli:check_train", 150, 150),
    "dp_vs_ddp_exact": ("dp_exact:check_dp_vs_ddp_exact", 120, 120),
    "compressors": ("compressors:check_compressors", 60, 60),
    "pipelines": ("pipelines:check_pipelines", 60, 60),
    "dp_vs_ddp_speed": ("timing:check_dp_vs_ddp_speed", 90, 90),
    "pipeline_memory": ("pipelines:check_pipeline_memory", 60, 60),
    "host_syncs": ("syncs:check_host_syncs", 60, 30),
}
#: checks that only measure CUDA: elsewhere their function returns a "skipped" record at once,
#: so it runs in the runner's process (a fresh interpreter would cost seconds of imports)
CUDA_ONLY = frozenset({"host_syncs"})
ROOT = Path(__file__).resolve().parents[2]  # the checks run as modules of this checkout
BUDGET_S = {"cuda": 450.0, "cpu": 300.0}  # the whole run: under 8 min on a GPU, 5 on a CPU
OUT = {"cuda": "benchmarks/results/gpu_check.json", "cpu": "benchmarks/results/gpu_check_cpu.json"}


def resolve(name: str) -> Callable[[str], Record]:
    """The function of check ``name``."""
    import importlib

    module, _, fn = CHECKS[name][0].partition(":")
    check: Callable[[str], Record] = getattr(
        importlib.import_module(f"benchmarks.gpu_check.{module}"), fn
    )
    return check


def run_one(name: str, device: str, record_path: Path) -> int:
    """In the check's own interpreter: run it, write its record to ``record_path``."""
    try:
        record = resolve(name)(device)
    except Exception as exc:
        import traceback

        record = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        record["traceback"] = tail(traceback.format_exc(), 25)
    write_json(record_path, record)
    return 0


def isolated(name: str, device: str, timeout_s: float) -> Record:
    """Check ``name`` in a fresh interpreter bounded by ``timeout_s``; its record, with
    ``name``, ``ok`` and ``seconds`` first (a crash or timeout is a failed record)."""
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        path = Path(tmp) / "record.json"
        cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--device", device]
        t0 = time.monotonic()
        done = run_bounded([*cmd, "--one", name, "--record", str(path)], timeout_s, cwd=ROOT)
        seconds = round(time.monotonic() - t0, 2)
        if path.is_file():
            body: Record = json.loads(path.read_text())
        elif done.timed_out:
            body = {"ok": False, "error": f"timed out after {timeout_s:.0f}s (killed)"}
        else:
            body = {"ok": False, "error": f"exited with code {done.returncode}, no record"}
        if "ok" not in body or not body["ok"]:
            body["output_tail"] = tail(done.stdout + "\n" + done.stderr)
    return {"name": name, "ok": bool(body.pop("ok", False)), "seconds": seconds, **body}


def run_all(device: str, names: list[str], out: Path) -> Record:
    """Every check in ``names`` within the device's budget; the JSON rewritten after each."""
    env = environment(device)
    doc: Record = {"benchmark": "gpu_check", **env, "ok": False, "seconds": 0.0, "checks": []}
    start = time.monotonic()
    for name in names:
        left = BUDGET_S[device] - (time.monotonic() - start)
        rec = _check(name, device, left)
        doc["checks"].append(rec)
        doc["ok"] = all(c["ok"] for c in doc["checks"])
        doc["seconds"] = round(time.monotonic() - start, 2)
        write_json(out, doc)
        print(line(rec), flush=True)
    return doc


def _check(name: str, device: str, left_s: float) -> Record:
    """Check ``name``'s record: isolated under its limit (or what is left of the budget)."""
    if name in CUDA_ONLY and device != "cuda":
        t0 = time.monotonic()
        body = resolve(name)(device)
        seconds = round(time.monotonic() - t0, 2)
        return {"name": name, "ok": bool(body.pop("ok")), "seconds": seconds, **body}
    _, on_cuda, on_cpu = CHECKS[name]
    limit = min(on_cuda if device == "cuda" else on_cpu, left_s)
    if limit < 5:
        return {"name": name, "ok": False, "seconds": 0.0, "error": "no time left in budget"}
    return isolated(name, device, limit)


def line(rec: Record) -> str:
    """One summary line of a check."""
    verdict = "ok  " if rec["ok"] else "FAIL"
    error = f" -- {str(rec['error']).splitlines()[0][:150]}" if "error" in rec else ""
    note = f" ({rec['skipped']})" if "skipped" in rec else ""
    return f"gpu_check: {verdict} {rec['name']:<16} {rec['seconds']:7.1f}s{note}{error}"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="scripts/gpu_check.sh", description=(__doc__ or "").splitlines()[0]
    )
    ap.add_argument("--device", default="cuda", help=f"one of {', '.join(DEVICES)}")
    ap.add_argument("--out", default=None, help="the JSON (default: by device, see above)")
    ap.add_argument(
        "--checks", default=",".join(CHECKS), help="comma-separated subset, run in this order"
    )
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the runner's child
    ap.add_argument("--record", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def _problem(a: argparse.Namespace) -> str | None:
    """What is wrong with the arguments, before any work; ``None`` when nothing."""
    if a.device not in DEVICES:
        return f"--device {a.device!r} is not supported; valid: {', '.join(DEVICES)}"
    bad = [n for n in a.checks.split(",") if n not in CHECKS]
    if bad:
        return f"unknown check(s) {bad}; valid: {', '.join(CHECKS)}"
    if a.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            return "--device cuda but no CUDA device is visible; use --device cpu"
    return None


def main(argv: list[str] | None = None) -> int:
    a = _parse(argv)
    problem = _problem(a)
    if problem:
        print(f"gpu_check: error: {problem}", file=sys.stderr)
        return 2
    if a.one is not None:
        return run_one(a.one, a.device, Path(a.record))
    out = Path(a.out or OUT[a.device])
    doc = run_all(a.device, a.checks.split(","), out)
    failed = [c["name"] for c in doc["checks"] if not c["ok"]]
    print(
        f"gpu_check: {len(doc['checks']) - len(failed)}/{len(doc['checks'])} checks passed on "
        f"{doc['device']} ({doc['device_name']}) in {doc['seconds']:.0f}s -> {out}"
        + (f"; failed: {', '.join(failed)}" if failed else "")
    )
    return 0 if not failed else 1
