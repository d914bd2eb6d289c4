"""Low-bandwidth data parallelism: syncline's compressors vs torch DDP (and its comm hooks).

Two emulated hosts (one rank each, its own network namespace) joined by a switch whose ports
are capped at ``--rate`` (default 100 Mbit/s) both ways by ``tc tbf``
(:class:`syncline.launch.netns.EmulatedNetwork`). Every configuration trains the same byte-level
GPT on the same stdlib text, from the same initialisation, with the same optimizer, batches and
number of steps; only the data-parallel engine and its gradient compression differ:

    none fp16 bf16 csc topk powersgd        syncline.DataParallel + compressor
    ddp ddp-fp16 ddp-powersgd               torch DDP, plain / fp16_compress_hook / powerSGD_hook

The parent process builds the network, then re-invokes this file once per rank, inside that
rank's namespace (``ip netns exec``), with a JSON config; the ranks rendezvous over TCP on
host 0's emulated address. By default (``--schedule interleaved``) one pair of ranks trains
all configurations side by side, one step of each in turn (order rotating every step, a
barrier before each timed step), so that all of them meet the same background load on this
shared 2-core machine; ``--schedule sequential`` starts one pair of ranks per configuration.
The network is deleted at the end, also on errors and signals (EmulatedNetwork's cleanup).

    sudo .venv/bin/python benchmarks/lowbw.py                     # ~13-15 min on 2 cores
    sudo .venv/bin/python benchmarks/lowbw.py --steps 60          # quick look
    .venv/bin/python benchmarks/lowbw.py --loopback               # fast network (127.0.0.1)

Design choices (all are options):

* Model: GPT 4 layers x 256 wide, 4 heads, block 64: 3.30 M parameters, 13.2 MB of fp32
  gradient per step, about 1.1 s of wire time at 100 Mbit/s, against ~0.1 s of compute for 4
  sequences of 64 bytes per rank (1 thread per rank): the allreduce dominates the step, as in
  the bandwidth-starved clusters CSC targets. Comm/compute does not depend on the parameter
  count (both scale with it), only on tokens per rank, hence the small per-rank batch.
* Optimizer: SGD, momentum 0.9, lr 0.02 (constant), for every configuration; CSC gets
  ``momentum=0`` in SGD and 0.9 inside CSC (momentum correction). SGD does learn in the step
  budget (loss 5.5 -> ~2.8 in 150 steps), so AdamW was not needed. The lr was chosen for
  the *dense* baseline (sweep 0.02 / 0.035 / 0.05 / 0.1 / 0.2, with and without warm-up and
  cosine decay: 0.02-0.035 best, >= 0.1 unstable), not for CSC.
* Warm-up: ``--warmup-steps`` (15, 10 % of the default budget) dense steps for csc and
  powersgd, and DDP's PowerSGD hook gets ``start_powerSGD_iter`` equal to it (DDP requires
  >= 2). topk has no warm-up option. The first ``--warmup-steps`` steps are excluded from the
  median samples/s of *every* configuration (one window for all).
* CSC chunk size: 256 elements, so 1 % density means ~129 of ~12.9 k chunks per step (the
  32768 default would give 101 chunks and send 2 of them); scores cost 4 bytes per chunk.
* Buckets: ``--bucket-cap-mb 25`` is passed to both engines, so each has ONE bucket for
  this model (an explicit cap also drops DDP's 1 MiB first bucket). With several buckets
  DDP's PowerSGD hook can deadlock on gloo (observed at 4 MiB: both gloo worker threads
  blocked in the hook's ``wait()``), so the benchmark keeps one bucket and warns otherwise.
* Wire bytes per step and rank (payload, before the ring's 2(p-1)/p): syncline reports its own
  (``DataParallel.last_stats.wire_bytes``); for DDP they are computed: 4 bytes/parameter plain,
  2 for fp16, and for the PowerSGD hook 4 bytes times (uncompressed elements + P + Q sizes),
  taken from the hook's own ``total_numel_after_compression`` counter and cross-checked
  against the sizes derived from the parameter shapes.
* Loss: rank 0's training loss at every step (same batches for every configuration), smoothed
  by a trailing mean of ``--smooth`` steps (default 10 % of the steps, the final-loss window,
  so DDP's own smoothed curve ends exactly on its final loss); final loss = mean of the last
  10 % of steps;
  time-to-target = wall time from the first step until the smoothed curve first reaches
  DDP-plain's final loss.

``--loopback`` runs instead on 127.0.0.1 (``syncline.testing.run_ranks``), all engines in one
pair of processes, timed in rotating segments so that drift favours none, and reports each
compressor's samples/s relative to plain DDP (``--loopback-global-batch N`` repeats it at
another batch, stored as ``loopback_batchN``). Results go to ``--out`` (default
``benchmarks/results/lowbw.json``); each mode replaces only its own section of that file.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere: import the checkout's syncline
    sys.path.insert(0, str(REPO))

SYNCLINE_CONFIGS = ("none", "fp16", "bf16", "csc", "topk", "powersgd")
DDP_CONFIGS = ("ddp", "ddp-fp16", "ddp-powersgd")
CONFIGS = SYNCLINE_CONFIGS + DDP_CONFIGS
WORLD = 2

FLOORS = {
    "csc_over_ddp_samples_per_s": 5.0,
    "time_to_ddp_final_loss_speedup": 3.0,
    "loopback_min_ratio": 0.9,
}


# ---------------------------------------------------------------------------------------------
# shared by both modes: engines, training, wire bytes
# ---------------------------------------------------------------------------------------------
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


def _gpt_numel(s: dict[str, Any]) -> int:
    from syncline.models import build_model

    shape = {k: s[k] for k in ("n_layer", "n_embd", "n_head", "block_size")}
    return sum(p.numel() for p in build_model("gpt", **shape).parameters())


def _build_engine(name: str, model: Any, s: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
    """(engine, wire_bytes(step) -> int, info) for configuration ``name``."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from syncline import DataParallel
    from syncline.dp.compression import NoCompression
    from syncline.dp.compressors import BF16, CSC, FP16, PowerSGD, TopK
    from syncline.dp.compressors import chunks as ch

    n_params = sum(p.numel() for p in model.parameters())
    warm = s["warmup_steps"]
    info: dict[str, Any] = {}
    if name in DDP_CONFIGS:
        ddp = DDP(model, bucket_cap_mb=s["bucket_cap_mb"])
        if name == "ddp":
            return ddp, lambda step: 4 * n_params, info
        if name == "ddp-fp16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
            return ddp, lambda step: 2 * n_params, info
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        start = max(2, warm)  # DDP refuses < 2 with error feedback / warm start
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
    del torch
    return dp, lambda step: int(dp.last_stats.wire_bytes), info


def _setup(rank: int, world: int, s: dict[str, Any], name: str) -> dict[str, Any]:
    """Model (same init on every rank and config), engine, optimizer and this rank's batches."""
    import torch

    from syncline.data import ByteDataset, ShardedBatches, stdlib_corpus
    from syncline.models import build_model

    torch.manual_seed(s["seed"])
    model = build_model(
        "gpt",
        n_layer=s["n_layer"],
        n_embd=s["n_embd"],
        n_head=s["n_head"],
        block_size=s["block_size"],
    )
    n_params = sum(p.numel() for p in model.parameters())
    engine, wire, info = _build_engine(name, model, s)
    # CSC applies the momentum itself (momentum correction): the optimizer must not.
    momentum = 0.0 if name == "csc" else s["momentum"]
    opt = torch.optim.SGD(engine.parameters(), lr=s["lr"], momentum=momentum)
    data = ByteDataset(stdlib_corpus(s["corpus_bytes"]), s["block_size"])
    batches = ShardedBatches(data, s["global_batch"], rank, world, s["seed"])
    return {
        "engine": engine,
        "wire": wire,
        "info": info,
        "opt": opt,
        "batches": batches,
        "n_params": n_params,
        "step": 0,
        "opt_momentum": momentum,
    }


def _step(run: dict[str, Any]) -> tuple[float, int]:
    """One training step; returns (local loss, wire bytes this rank sent)."""
    from syncline.models import lm_loss

    step = run["step"]
    x, y = run["batches"].batch(step)
    run["opt"].zero_grad(set_to_none=True)
    loss = lm_loss(run["engine"](x), y)
    loss.backward()
    run["opt"].step()
    run["step"] = step + 1
    return loss.item(), run["wire"](step)


def _train(rank: int, world: int, s: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """Train every configuration in ``names`` for ``s['steps']`` steps, one step of each in
    turn (the order rotating every step), so that all of them see the same background load
    over the whole run. Each step starts after a barrier, so both ranks start it together;
    its time ends when rank 0's step (including the collective) is done."""
    from syncline import comm

    runs = {name: _setup(rank, world, s, name) for name in names}
    seconds: dict[str, list[float]] = {name: [] for name in names}
    losses: dict[str, list[float]] = {name: [] for name in names}
    wire: dict[str, list[int]] = {name: [] for name in names}
    for step in range(s["steps"]):
        k = step % len(names)
        for name in names[k:] + names[:k]:
            comm.barrier(what=f"{name} step {step}")
            t0 = time.perf_counter()
            loss, nbytes = _step(runs[name])
            seconds[name].append(time.perf_counter() - t0)
            losses[name].append(loss)
            wire[name].append(nbytes)
    comm.barrier(what="end of training")
    out = {}
    for name, run in runs.items():
        times, acc = [], 0.0
        for dt in seconds[name]:
            acc += dt
            times.append(acc)
        out[name] = {
            "config": name,
            "n_params": run["n_params"],
            "optimizer_momentum": run["opt_momentum"],
            "info": run["info"],
            "times": times,
            "losses": losses[name],
            "wire_bytes": wire[name],
        }
    return out


def _probe_link(numel: int, reps: int) -> dict[str, Any]:
    """Time raw gloo allreduces of ``numel`` fp32 on the emulated link (a sanity check)."""
    import torch

    from syncline import comm
    from syncline.comm import FlatAllreduce

    ar = FlatAllreduce(timeout_s=300.0)
    buf = torch.ones(numel)
    ar.allreduce(buf, "probe warm-up").wait()
    secs = []
    for i in range(reps):
        comm.barrier(what="probe")
        t0 = time.perf_counter()
        ar.allreduce(buf, f"probe {i}").wait()
        secs.append(time.perf_counter() - t0)
    t = statistics.median(secs)
    nbytes = 4 * numel
    return {
        "bytes": nbytes,
        "seconds_median": t,
        # each of 2 ranks sends n bytes in a ring allreduce (n/2 reduce-scatter + n/2 gather)
        "per_rank_send_mbit_per_s": nbytes * 8 * 2 * (WORLD - 1) / WORLD / t / 1e6,
    }


# ---------------------------------------------------------------------------------------------
# emulated network: parent and per-rank worker
# ---------------------------------------------------------------------------------------------
def _worker(cfg_json: str) -> int:
    """Entry point of one rank inside its namespace (``--worker JSON``)."""
    import torch
    import torch.distributed as dist

    cfg = json.loads(cfg_json)
    torch.set_num_threads(1)
    rank, world = cfg["rank"], cfg["world"]
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{cfg['addr']}:{cfg['port']}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=cfg["comm_timeout_s"]),
    )
    try:
        if cfg["configs"] == ["probe"]:
            result: dict[str, Any] = _probe_link(cfg["probe_numel"], 3)
        else:
            result = _train(rank, world, cfg["settings"], cfg["configs"])
        if rank == 0:
            Path(cfg["result"]).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
    return 0


def _run_on_network(
    net: Any, name: str, cfg: dict[str, Any], tmp: Path, timeout_s: float
) -> dict[str, Any]:
    """Start both ranks of one configuration in their namespaces and collect rank 0's result."""
    from syncline.launch.netns import HOST_IFNAME

    env = {
        **os.environ,
        "GLOO_SOCKET_IFNAME": HOST_IFNAME,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        ),
    }
    result_path = tmp / f"{name}.json"
    procs, logs = [], []
    try:
        for r in range(WORLD):
            rank_cfg = {**cfg, "rank": r, "world": WORLD, "result": str(result_path)}
            log = open(tmp / f"{name}.rank{r}.log", "w+")  # noqa: SIM115 (closed below)
            logs.append(log)
            argv = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(rank_cfg)]
            procs.append(
                subprocess.Popen(
                    net.exec_argv(r, argv), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO
                )
            )
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        time.sleep(0.5)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    codes = [p.returncode for p in procs]
    if codes != [0] * WORLD or not result_path.exists():
        tails = []
        for r, log in enumerate(logs):
            log.seek(0)
            tails.append(f"rank {r} (exit {codes[r]}): {log.read()[-3000:]}")
        for log in logs:
            log.close()
        raise RuntimeError(f"{name} failed:\n" + "\n".join(tails))
    for log in logs:
        log.close()
    out: dict[str, Any] = json.loads(result_path.read_text())
    return out


def _smooth(xs: list[float], window: int) -> list[float]:
    """Trailing mean over the last ``window`` values (fewer at the start)."""
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= window:
            acc -= xs[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _summarise(res: dict[str, Any], s: dict[str, Any]) -> dict[str, Any]:
    times, losses, wire = res["times"], res["losses"], res["wire_bytes"]
    n = len(times)
    dts = [times[0]] + [b - a for a, b in itertools.pairwise(times)]
    skip = min(max(s["warmup_steps"], 3), n - 1)  # the same window for every configuration
    steady = dts[skip:]
    tail = max(1, math.ceil(0.1 * n))
    smoothed = _smooth(losses, s["smooth"])
    finite = all(math.isfinite(x) for x in losses[-tail:])
    return {
        "config": res["config"],
        "n_params": res["n_params"],
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


def _time_to(summary: dict[str, Any], target: float) -> dict[str, Any]:
    for i, v in enumerate(summary["loss_curve_smoothed"]):
        if v <= target:
            return {"step": i + 1, "seconds": summary["step_end_times_s"][i]}
    return {"step": None, "seconds": None}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _emulated(a: argparse.Namespace, s: dict[str, Any]) -> dict[str, Any]:
    from syncline.launch.netns import EmulatedNetwork, check_prerequisites

    check_prerequisites()
    names = [c for c in a.configs.split(",") if c]
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        raise SystemExit(f"lowbw: unknown config(s) {unknown}; valid: {', '.join(CONFIGS)}")
    grad_mb = 4 * _gpt_numel(s) / 2**20
    if "ddp-powersgd" in names and s["bucket_cap_mb"] < grad_mb:
        print(
            f"[lowbw] warning: --bucket-cap-mb {s['bucket_cap_mb']} < {grad_mb:.1f} MiB of "
            "gradients gives DDP several buckets; its PowerSGD hook then can deadlock on gloo "
            "(its callbacks block gloo's worker threads in wait()); seen here with 4 MiB",
            file=sys.stderr,
            flush=True,
        )
    raw: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    started = time.perf_counter()
    probe = None
    with (
        tempfile.TemporaryDirectory(prefix="lowbw-") as tmpdir,
        EmulatedNetwork(WORLD, a.rate) as net,
    ):
        tmp = Path(tmpdir)
        base = {
            "addr": net.hosts[0][1],
            "settings": s,
            "comm_timeout_s": a.comm_timeout,
            "probe_numel": 1 << 20,
        }
        jobs = [["probe"]] if not a.no_probe else []
        jobs += [names] if a.schedule == "interleaved" else [[name] for name in names]
        for i, job in enumerate(jobs):
            label = "+".join(job)
            cfg = {**base, "configs": job, "port": a.port + i}
            t0 = time.perf_counter()
            timeout = a.config_timeout * (1 if job == ["probe"] else len(job))
            try:
                res = _run_on_network(net, label, cfg, tmp, timeout)
            except RuntimeError as exc:
                for name in job:
                    errors[name] = str(exc)
                print(f"[lowbw] {label}: FAILED\n{exc}", file=sys.stderr, flush=True)
                continue
            if job == ["probe"]:
                probe = res
                print(
                    f"[lowbw] link probe: {res['bytes'] / 1e6:.1f} MB allreduce in "
                    f"{res['seconds_median']:.2f} s = {res['per_rank_send_mbit_per_s']:.1f} "
                    "Mbit/s per rank",
                    flush=True,
                )
                continue
            print(f"[lowbw] {label}: {time.perf_counter() - t0:.0f} s", flush=True)
            for name in job:
                raw[name] = res[name]
                summ = _summarise(res[name], s)
                print(
                    f"[lowbw] {name:13s} {summ['samples_per_s_median']:7.2f} samples/s  "
                    f"{summ['wire_bytes_per_step_median'] / 1e6:8.3f} MB/step  "
                    f"final loss {summ['final_loss']:.4f}",
                    flush=True,
                )
    summaries = {name: _summarise(res, s) for name, res in raw.items()}
    if "ddp" in summaries:
        target = summaries["ddp"]["final_loss"]
        for summ in summaries.values():
            summ["time_to_ddp_final_loss"] = _time_to(summ, target)
    ratios = _ratios(summaries)
    return {
        "rate": a.rate,
        "world_size": WORLD,
        "schedule": a.schedule,
        "settings": s,
        "link_probe": probe,
        "wall_seconds": time.perf_counter() - started,
        "configs": summaries,
        "ratios": ratios,
        "floors": _floors_emulated(ratios),
        "errors": errors,
    }


def _ratios(summ: dict[str, dict[str, Any]]) -> dict[str, Any]:
    def get(name: str, key: str) -> Any:
        return summ.get(name, {}).get(key)

    def ttt(name: str) -> Any:
        return (get(name, "time_to_ddp_final_loss") or {}).get("seconds")

    out: dict[str, Any] = {
        "csc_over_ddp_samples_per_s": _ratio(
            get("csc", "samples_per_s_median"), get("ddp", "samples_per_s_median")
        ),
        "csc_over_ddp_powersgd_samples_per_s": _ratio(
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
        "time_to_ddp_final_loss_speedup": _ratio(ttt("ddp"), ttt("csc")),
        "samples_per_s_over_ddp": {
            name: _ratio(get(name, "samples_per_s_median"), get("ddp", "samples_per_s_median"))
            for name in summ
        },
        "wire_bytes_per_step_over_ddp": {
            name: _ratio(
                get(name, "wire_bytes_per_step_median"), get("ddp", "wire_bytes_per_step_median")
            )
            for name in summ
        },
        "time_to_ddp_final_loss_speedup_by_config": {
            name: _ratio(ttt("ddp"), ttt(name)) for name in summ
        },
    }
    return out


def _floors_emulated(r: dict[str, Any]) -> dict[str, Any]:
    def ge(x: Any, lo: float) -> bool | None:
        return None if x is None else bool(x >= lo)

    loss_ok = None
    if r["csc_final_loss"] is not None and r["ddp_powersgd_final_loss"] is not None:
        loss_ok = bool(r["csc_final_loss"] <= r["ddp_powersgd_final_loss"])
    faster = ge(r["csc_over_ddp_powersgd_samples_per_s"], 1.0)
    return {
        "csc_ge_5x_ddp_samples_per_s": ge(
            r["csc_over_ddp_samples_per_s"], FLOORS["csc_over_ddp_samples_per_s"]
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
            else ge(r["time_to_ddp_final_loss_speedup"], FLOORS["time_to_ddp_final_loss_speedup"])
        ),
    }


# ---------------------------------------------------------------------------------------------
# loopback: every engine in one pair of local processes, timed in rotating segments
# ---------------------------------------------------------------------------------------------
def _loopback_rank(
    rank: int, world: int, s: dict[str, Any], names: list[str], rounds: int, seg: int
) -> dict[str, Any]:
    from syncline import comm

    runs = {}
    for name in names:
        run = _setup(rank, world, s, name)
        for _ in range(s["warmup_steps"] + 2):  # past every dense warm-up: time the real path
            _step(run)
        runs[name] = run
    seconds: dict[str, list[float]] = {name: [] for name in names}
    wire: dict[str, int] = {}
    for r in range(rounds):
        k = r % len(names)
        order = names[k:] + names[:k]
        if r % 2:
            order = order[::-1]
        for name in order:
            comm.barrier(what=f"loopback {name} segment")
            t0 = time.perf_counter()
            for _ in range(seg):
                _, wire[name] = _step(runs[name])
            comm.barrier(what=f"loopback {name} segment end")
            seconds[name].append(time.perf_counter() - t0)
    return {"seconds": seconds, "wire": wire}


def _loopback(a: argparse.Namespace, s: dict[str, Any]) -> dict[str, Any]:
    from syncline.testing import run_ranks

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # 127.0.0.1; the spawned ranks inherit it
    if a.loopback_global_batch:
        if a.loopback_global_batch % WORLD:
            raise SystemExit(f"lowbw: --loopback-global-batch must be a multiple of {WORLD}")
        s = {**s, "global_batch": a.loopback_global_batch}
    names = [c for c in a.loopback_configs.split(",") if c]
    if "ddp" not in names:
        names.append("ddp")
    started = time.perf_counter()
    res = run_ranks(
        _loopback_rank,
        WORLD,
        s,
        names,
        a.loopback_rounds,
        a.loopback_segment,
        timeout_s=a.config_timeout * 2,
        comm_timeout_s=a.comm_timeout,
    )[0]
    samples = s["global_batch"] * a.loopback_segment
    sps = {n: [samples / t for t in ts] for n, ts in res["seconds"].items()}
    med = {n: statistics.median(v) for n, v in sps.items()}
    configs = {}
    for n in names:
        per_round = [x / d for x, d in zip(sps[n], sps["ddp"], strict=True)]
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
        "settings": s,
        "rounds": a.loopback_rounds,
        "steps_per_segment": a.loopback_segment,
        "wall_seconds": time.perf_counter() - started,
        "configs": configs,
        "ratios": {n: configs[n][key] for n in names},
        "ratios_of_medians": {n: configs[n]["over_ddp"] for n in names},
        "floors": {
            "metric": key,
            "worst_compressor": worst,
            "worst_over_ddp": None if worst is None else configs[worst][key],
            "no_compressor_slower_than_ddp_by_more_than_10pct": (
                None if worst is None else bool(configs[worst][key] >= FLOORS["loopback_min_ratio"])
            ),
        },
    }


# ---------------------------------------------------------------------------------------------
def _settings(a: argparse.Namespace) -> dict[str, Any]:
    if a.global_batch % WORLD:
        raise SystemExit(f"lowbw: --global-batch must be a multiple of {WORLD}")
    return {
        "n_layer": a.n_layer,
        "n_embd": a.n_embd,
        "n_head": a.n_head,
        "block_size": a.block_size,
        "global_batch": a.global_batch,
        "steps": a.steps,
        "warmup_steps": a.warmup_steps,
        "optimizer": "SGD",
        "lr": a.lr,
        "momentum": a.momentum,
        "density": a.density,
        "chunk_elems": a.chunk_elems,
        "topk_ratio": a.topk_ratio,
        "powersgd_rank": a.powersgd_rank,
        "bucket_cap_mb": a.bucket_cap_mb,
        "seed": a.seed,
        "smooth": a.smooth if a.smooth > 0 else max(1, math.ceil(0.1 * a.steps)),
        "corpus_bytes": a.corpus_bytes,
        "threads_per_rank": 1,
    }


def _merge_write(path: Path, key: str, section: dict[str, Any]) -> None:
    import torch

    doc: dict[str, Any] = {}
    if path.exists():
        try:
            doc = json.loads(path.read_text())
        except json.JSONDecodeError:
            doc = {}
    doc.update(benchmark="lowbw", torch=torch.__version__)
    doc[key] = section
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")


def _print_emulated(e: dict[str, Any]) -> None:
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--rate", default="100mbit", help="per-host link rate (tc units)")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--warmup-steps", type=int, default=15)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--global-batch", type=int, default=8, help="sequences per step, all ranks")
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--chunk-elems", type=int, default=256)
    ap.add_argument("--topk-ratio", type=float, default=0.01)
    ap.add_argument("--powersgd-rank", type=int, default=4)
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--smooth",
        type=int,
        default=0,
        help="loss smoothing window in steps; 0: 10%% of --steps, the final-loss window",
    )
    ap.add_argument("--corpus-bytes", type=int, default=4_000_000)
    ap.add_argument("--port", type=int, default=29620)
    ap.add_argument("--comm-timeout", type=float, default=300.0)
    ap.add_argument("--config-timeout", type=float, default=900.0)
    ap.add_argument(
        "--schedule",
        choices=("interleaved", "sequential"),
        default="interleaved",
        help="interleaved: all configs in one pair of ranks, one step of each in turn "
        "(same background load for all); sequential: one pair of ranks per config",
    )
    ap.add_argument("--no-probe", action="store_true", help="skip the raw link probe")
    ap.add_argument("--loopback", action="store_true", help="fast-network mode only")
    ap.add_argument("--both", action="store_true", help="emulated link, then loopback")
    ap.add_argument("--loopback-configs", default=",".join((*SYNCLINE_CONFIGS, "ddp")))
    ap.add_argument(
        "--loopback-global-batch",
        type=int,
        default=0,
        help="loopback only: sequences per step (0: --global-batch, the emulated run's)",
    )
    ap.add_argument("--loopback-rounds", type=int, default=7)
    ap.add_argument("--loopback-segment", type=int, default=10)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "lowbw.json"))
    a = ap.parse_args(argv)
    if a.worker:
        return _worker(a.worker)
    s = _settings(a)
    out = Path(a.out)
    if not a.loopback:
        e = _emulated(a, s)
        _merge_write(out, "emulated", e)
        _print_emulated(e)
    if a.loopback or a.both:
        lb = _loopback(a, s)
        key = f"loopback_batch{a.loopback_global_batch}" if a.loopback_global_batch else "loopback"
        _merge_write(out, key, lb)
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
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
