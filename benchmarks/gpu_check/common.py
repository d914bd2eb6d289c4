"""What every check shares: the device and backend of a rank, bounded subprocesses, the small
models and batches, and comparisons of state dicts.

One device string names a run: ``"cuda"`` (NCCL for one rank per GPU; gloo carries CUDA
tensors in collectives, so two ranks may share the one GPU through gloo) or ``"cpu"`` (gloo).
"""

from __future__ import annotations

import contextlib
import os
import platform
import signal
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from syncline.comm.device import local_device
from syncline.models import build_model
from syncline.testing import run_ranks

Record = dict[str, Any]
DEVICES = ("cuda", "cpu")
COMM_TIMEOUT_S = 30.0  # any one collective; a rank that waits longer fails, naming it

#: the pipelines' GPT: embedding, 2 blocks, head (4 layers), as small as the suite's
TINY_GPT = {"n_layer": 2, "n_embd": 16, "n_head": 2, "block_size": 8}


def backend_for(device: str) -> str:
    """The backend of one rank per device: NCCL on CUDA, gloo on the CPU."""
    return "nccl" if device == "cuda" else "gloo"


def rank_device(device: str, rank: int) -> torch.device:
    """This rank's device (``cuda:rank % GPUs``, made current, or the CPU)."""
    dev = local_device(device, rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return dev


def device_ids(dev: torch.device) -> list[int] | None:
    """DDP's ``device_ids`` for a module on ``dev``: its GPU, or ``None`` off CUDA."""
    if dev.type != "cuda":
        return None
    return [dev.index if dev.index is not None else torch.cuda.current_device()]


def ranks(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    backend: str,
    timeout_s: float,
) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` local ranks of ``backend``; every result."""
    return run_ranks(
        fn, world, *args, backend=backend, timeout_s=timeout_s, comm_timeout_s=COMM_TIMEOUT_S
    )


@dataclass(frozen=True)
class Finished:
    """A bounded subprocess: its exit code (``None``: killed at the limit) and its output."""

    returncode: int | None
    stdout: str
    stderr: str

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


def run_bounded(
    cmd: Sequence[str],
    timeout_s: float,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> Finished:
    """Run ``cmd``; past ``timeout_s`` kill it with every process it started (torchrun's
    workers, forked ranks, nested bounded runs in sessions of their own), so nothing outlives
    a check and nothing waits on a pipe a survivor holds open."""
    proc = subprocess.Popen(
        list(cmd),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=None if env is None else dict(env),
        cwd=cwd,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
        return Finished(proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:  # a pipe still held open: give up on the output
            out, err = "", "(output lost: the pipes stayed open after the kill)"
        return Finished(None, out, err)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
            proc.wait(timeout=10)


def _children() -> dict[int, list[int]]:
    """Parent pid -> child pids, from ``/proc`` (Linux; empty elsewhere)."""
    tree: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        tree.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    return tree


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``'s process group and every descendant of ``pid`` (found before the
    first kill, so none is re-parented away)."""
    tree, found, todo = _children(), [], [pid]
    while todo:
        found.extend(todo)
        todo = [c for p in todo for c in tree.get(p, [])]
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    for p in found:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)


def tail(text: str, lines: int = 15) -> str:
    """The last ``lines`` lines of ``text`` (a failure's useful end)."""
    return "\n".join(text.strip().splitlines()[-lines:])


def environment(device: str) -> Record:
    """Device name, torch, CUDA and NCCL versions: the header of the JSON."""
    env: Record = {
        "device": device,
        "device_name": _cpu_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": None,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
    }
    if device == "cuda":
        env["device_name"] = torch.cuda.get_device_name(0)
        env["device_count"] = torch.cuda.device_count()
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        version = torch.cuda.nccl.version()  # a tuple; an int in older torch
        env["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else version
    return env


def _cpu_name() -> str:
    """The CPU's model name (Linux), else the machine type."""
    try:
        with open("/proc/cpuinfo") as f:
            for text in f:
                if text.startswith("model name"):
                    return text.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# -- models and batches -----------------------------------------------------------------------


def mlp(seed: int = 0) -> nn.Sequential:
    """Three linear layers (several buckets at small caps), initialised from ``seed``."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)
    )


def mlp_batch(step: int, rank: int, world: int, size: int = 16) -> tuple[torch.Tensor, ...]:
    """Rank ``rank``'s shard of the global batch of ``step`` (drawn on the CPU: the same
    numbers whatever the device)."""
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(size, 32, generator=g), torch.randint(0, 10, (size,), generator=g)
    local = size // world
    return x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local]


def gpt(seed: int = 0, **shape: Any) -> nn.Sequential:
    """The registry's GPT (an ``nn.Sequential``, so it splits into stages), built on the CPU
    from ``seed``: the same weights on every device."""
    torch.manual_seed(seed)
    return build_model("gpt", **{**TINY_GPT, **shape})


def lm_batches(
    steps: int, batch: int = 8, seq: int = 8, seed: int = 1
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` batches of random bytes and their next-byte targets, drawn on the CPU."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randint(0, 256, (batch, seq), generator=g)
        out.append((x, torch.roll(x, -1, dims=1)))
    return out


# -- comparisons ------------------------------------------------------------------------------


def cpu_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Detached CPU copies of ``module``'s state (floating tensors in fp32)."""
    return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}


def max_abs_diff(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> float:
    """The largest ``|got - want|`` over every tensor (``inf`` when the names differ)."""
    if set(got) != set(want):
        return float("inf")
    worst = 0.0
    for key, w in want.items():
        if w.is_floating_point():
            worst = max(worst, float((got[key].double() - w.double()).abs().max()))
        elif not torch.equal(got[key], w):
            return float("inf")
    return worst


def bit_equal(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> bool:
    """Whether every tensor of ``got`` equals ``want``'s bit for bit (same names too)."""
    return set(got) == set(want) and all(torch.equal(got[k], w) for k, w in want.items())


def moved(state: Mapping[str, torch.Tensor], start: Mapping[str, torch.Tensor]) -> bool:
    """Whether training changed some weight: a no-op engine would match any reference."""
    return any(not torch.equal(state[k], start[k]) for k in start if "weight" in k)
