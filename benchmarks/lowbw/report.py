"""lowbw's summaries: per-configuration figures, the ratios to DDP, the floor checks, printing.

Pure functions of the ranks' raw results; the floors themselves are ``FLOORS`` in
:mod:`benchmarks.lowbw.main`, passed in.

Loss: rank 0's training loss at every step (same batches for every configuration), smoothed by
a trailing mean of ``smooth`` steps; final loss = mean of the last 10 % of steps;
time-to-target = wall time from the first step until the smoothed curve first reaches
DDP-plain's final loss.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
from typing import Any

from benchmarks.lowbw.engines import SYNCLINE_CONFIGS
from syncline.testing.bench import paired_ratios, ratio, step_split


def _smooth(xs: list[float], window: int) -> list[float]:
    """Trailing mean over the last ``window`` values (fewer at the start)."""
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= window:
            acc -= xs[i - window]
        out.append(acc / min(i + 1, window))
    return out


def summarise(res: dict[str, Any], s: dict[str, Any]) -> dict[str, Any]:
    """One configuration's figures from rank 0's per-step times, losses and wire bytes."""
    times, losses, wire = res["times"], res["losses"], res["wire_bytes"]
    n = len(times)
    dts = [times[0]] + [b - a for a, b in itertools.pairwise(times)]
    skip = min(max(s["warmup_steps"], 3), n - 1)  # the same window for every configuration
    steady = dts[skip:]
    tail = max(1, math.ceil(0.1 * n))
    smoothed = _smooth(losses, s["smooth"])
    finite = all(math.isfinite(x) for x in losses[-tail:])
    exposed = [x for x in res.get("exposed_comm_s", [])[skip:] if x is not None]
    breakdown = None
    if exposed:  # per step: compute (with compression's local work) and exposed communication
        step_s, exposed_s, compute_s = step_split(steady, exposed)
        breakdown = {"step_s": step_s, "exposed_comm_s": exposed_s, "compute_s": compute_s}
    return {
        "config": res["config"],
        "n_params": res["n_params"],
        "breakdown_median": breakdown,
        "optimizer_momentum": res["optimizer_momentum"],
        "info": res["info"],
        "steps": n,
        "steps_excluded_from_median": skip,
        "seconds_per_step_median": statistics.median(steady),
        "samples_per_s_median": s["global_batch"] / statistics.median(steady),
        "samples_per_s_overall": s["global_batch"] * n / times[-1],
        "total_seconds": times[-1],
        "wire_bytes_per_step_median": statistics.median(wire[skip:]),
        "wire_bytes_per_step_mean": sum(wire) / n,
        "wire_bytes_first_step": wire[0],
        "final_loss": sum(losses[-tail:]) / tail if finite else float("nan"),
        "loss_curve": losses,
        "loss_curve_smoothed": smoothed,
        "step_end_times_s": times,
    }


def time_to(summary: dict[str, Any], target: float) -> dict[str, Any]:
    """Step and wall time at which the smoothed loss first reaches ``target`` (or None)."""
    for i, v in enumerate(summary["loss_curve_smoothed"]):
        if v <= target:
            return {"step": i + 1, "seconds": summary["step_end_times_s"][i]}
    return {"step": None, "seconds": None}


def ratios(summ: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """CSC against DDP and DDP's PowerSGD hook, and every configuration over plain DDP."""

    def get(name: str, key: str) -> Any:
        return summ.get(name, {}).get(key)

    def ttt(name: str) -> Any:
        return (get(name, "time_to_ddp_final_loss") or {}).get("seconds")

    out: dict[str, Any] = {
        "csc_over_ddp_samples_per_s": ratio(
            get("csc", "samples_per_s_median"), get("ddp", "samples_per_s_median")
        ),
        "csc_over_ddp_powersgd_samples_per_s": ratio(
            get("csc", "samples_per_s_median"), get("ddp-powersgd", "samples_per_s_median")
        ),
        "csc_final_loss": get("csc", "final_loss"),
        "ddp_final_loss": get("ddp", "final_loss"),
        "ddp_powersgd_final_loss": get("ddp-powersgd", "final_loss"),
        "csc_minus_ddp_powersgd_final_loss": (
            None
            if get("csc", "final_loss") is None or get("ddp-powersgd", "final_loss") is None
            else get("csc", "final_loss") - get("ddp-powersgd", "final_loss")
        ),
        "csc_seconds_to_ddp_final_loss": ttt("csc"),
        "ddp_seconds_to_ddp_final_loss": ttt("ddp"),
        # > 1: CSC got there that many times sooner; None: CSC never got there in the budget
        "time_to_ddp_final_loss_speedup": ratio(ttt("ddp"), ttt("csc")),
        "samples_per_s_over_ddp": {
            name: ratio(get(name, "samples_per_s_median"), get("ddp", "samples_per_s_median"))
            for name in summ
        },
        # issue 16: each configuration's samples/s as a fraction of the compute-only bound
        # (the same model and steps under no_sync(), measured in the same run)
        "fraction_of_compute_bound": {
            name: ratio(get(name, "samples_per_s_median"), get("nosync", "samples_per_s_median"))
            for name in summ
        },
        "wire_bytes_per_step_over_ddp": {
            name: ratio(
                get(name, "wire_bytes_per_step_median"), get("ddp", "wire_bytes_per_step_median")
            )
            for name in summ
        },
        "time_to_ddp_final_loss_speedup_by_config": {
            name: ratio(ttt("ddp"), ttt(name)) for name in summ
        },
    }
    return out


def floors_emulated(r: dict[str, Any], floors: dict[str, float]) -> dict[str, Any]:
    """Which of the emulated run's floors the ``ratios`` meet (None: not measured)."""

    def ge(x: Any, lo: float) -> bool | None:
        return None if x is None else bool(x >= lo)

    loss_ok = None
    if r["csc_final_loss"] is not None and r["ddp_powersgd_final_loss"] is not None:
        loss_ok = bool(r["csc_final_loss"] <= r["ddp_powersgd_final_loss"])
    faster = ge(r["csc_over_ddp_powersgd_samples_per_s"], 1.0)
    return {
        "csc_ge_5x_ddp_samples_per_s": ge(
            r["csc_over_ddp_samples_per_s"], floors["csc_over_ddp_samples_per_s"]
        ),
        "csc_faster_than_ddp_powersgd": faster,
        "csc_loss_le_ddp_powersgd": loss_ok,
        "csc_faster_than_ddp_powersgd_at_equal_or_better_loss": (
            None if faster is None or loss_ok is None else faster and loss_ok
        ),
        "csc_time_to_ddp_final_loss_ge_3x_shorter": (
            False
            if r["ddp_seconds_to_ddp_final_loss"] is not None
            and r["csc_seconds_to_ddp_final_loss"] is None
            else ge(r["time_to_ddp_final_loss_speedup"], floors["time_to_ddp_final_loss_speedup"])
        ),
    }


def print_probe(probe: dict[str, Any]) -> None:
    print(
        f"[lowbw] link probe: {probe['bytes'] / 1e6:.1f} MB allreduce in "
        f"{probe['seconds_median']:.2f} s = {probe['per_rank_send_mbit_per_s']:.1f} "
        "Mbit/s per rank",
        flush=True,
    )


def print_progress(name: str, summ: dict[str, Any]) -> None:
    b = summ.get("breakdown_median")
    split = (
        f"  step {b['step_s'] * 1e3:.1f} ms = compute {b['compute_s'] * 1e3:.1f}"
        f" + exposed comm {b['exposed_comm_s'] * 1e3:.1f}"
        if b
        else ""
    )
    print(
        f"[lowbw] {name:13s} {summ['samples_per_s_median']:7.2f} samples/s  "
        f"{summ['wire_bytes_per_step_median'] / 1e6:8.3f} MB/step  "
        f"final loss {summ['final_loss']:.4f}{split}",
        flush=True,
    )


def print_emulated(e: dict[str, Any]) -> None:
    r = e["ratios"]

    def f(x: Any, spec: str = ".2f") -> str:
        return "n/a" if x is None else format(x, spec)

    print(f"\n== {e['rate']} emulated link, {e['settings']['steps']} steps ==")
    for name, c in e["configs"].items():
        t = (c.get("time_to_ddp_final_loss") or {}).get("seconds")
        over = f(r["samples_per_s_over_ddp"][name])
        print(
            f"{name:13s} {c['samples_per_s_median']:7.2f} samples/s  x{over}"
            f"  {c['wire_bytes_per_step_median'] / 1e6:8.3f} MB/step"
            f"  final {c['final_loss']:.4f}  to DDP loss: {f(t, '.1f')} s"
        )
    print(
        f"csc/ddp samples/s {f(r['csc_over_ddp_samples_per_s'])}, "
        f"csc/ddp-powersgd {f(r['csc_over_ddp_powersgd_samples_per_s'])}, "
        f"final loss csc {f(r['csc_final_loss'], '.4f')} "
        f"vs ddp-powersgd {f(r['ddp_powersgd_final_loss'], '.4f')} "
        f"(ddp {f(r['ddp_final_loss'], '.4f')}), "
        f"time-to-DDP-final-loss speedup {f(r['time_to_ddp_final_loss_speedup'])}"
    )
    print("floors:", json.dumps(e["floors"]))
    if e["errors"]:
        print("errors in:", ", ".join(e["errors"]))


def summarise_loopback(
    res: dict[str, Any], s: dict[str, Any], names: list[str], seg: int, floors: dict[str, float]
) -> dict[str, Any]:
    """Samples/s of every segment, each configuration over DDP, and the loopback floor."""
    samples = s["global_batch"] * seg
    sps = {n: [samples / t for t in ts] for n, ts in res["seconds"].items()}
    med = {n: statistics.median(v) for n, v in sps.items()}
    configs = {}
    for n in names:
        per_round = paired_ratios(sps[n], sps["ddp"])
        configs[n] = {
            "samples_per_s_median": med[n],
            "samples_per_s_segments": sps[n],
            "over_ddp": med[n] / med["ddp"],
            "over_ddp_median_of_rounds": statistics.median(per_round),
            "wire_bytes_last_step": res["wire"][n],
        }
    compressors = [n for n in names if n in SYNCLINE_CONFIGS]
    key = "over_ddp_median_of_rounds"  # paired by round: drift cancels; the floor uses it
    worst = min(compressors, key=lambda n: configs[n][key]) if compressors else None
    return {
        "configs": configs,
        "ratios": {n: configs[n][key] for n in names},
        "ratios_of_medians": {n: configs[n]["over_ddp"] for n in names},
        "floors": {
            "metric": key,
            "worst_compressor": worst,
            "worst_over_ddp": None if worst is None else configs[worst][key],
            "no_compressor_slower_than_ddp_by_more_than_10pct": (
                None if worst is None else bool(configs[worst][key] >= floors["loopback_min_ratio"])
            ),
        },
    }


def print_loopback(lb: dict[str, Any]) -> None:
    print(
        f"\n== loopback (127.0.0.1), global batch {lb['settings']['global_batch']}, "
        "samples/s over DDP =="
    )
    for name, c in lb["configs"].items():
        print(
            f"{name:13s} {c['samples_per_s_median']:7.2f} samples/s  x{c['over_ddp']:.3f}"
            f"  (median of rounds x{c['over_ddp_median_of_rounds']:.3f})"
        )
    print("floors:", json.dumps(lb["floors"]))
