"""scripts/gpu_check.sh's runner on the CPU: a subset of its checks end to end (the JSON's
schema), a check past its time limit recorded as failed, bad arguments refused before any
work, and the host-sync counter counting what it is shown (no GPU needed for that)."""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from benchmarks.gpu_check import common, syncs
from benchmarks.gpu_check import main as runner


@pytest.mark.slow  # runs two of gpu_check's checks end to end (a benchmark's runner)
def test_cpu_subset_writes_one_record_per_check(tmp_path) -> None:
    out = tmp_path / "gpu_check_cpu.json"
    rc = runner.main(["--device", "cpu", "--checks", "compressors,host_syncs", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert rc == 0, doc
    assert doc["benchmark"] == "gpu_check" and doc["device"] == "cpu" and doc["ok"] is True
    assert doc["torch"] == torch.__version__ and doc["device_name"]
    assert {"cuda", "nccl", "seconds"} <= set(doc)
    assert [c["name"] for c in doc["checks"]] == ["compressors", "host_syncs"]
    for check in doc["checks"]:
        assert check["ok"] is True and check["seconds"] >= 0, check
    compressors = doc["checks"][0]
    names = [c["compressor"] for c in compressors["compressors"]]
    assert {"none", "fp16", "bf16", "csc", "topk", "powersgd"} <= set(names)
    assert all(c["relative_error"] == 0.0 for c in compressors["compressors"])  # cpu vs cpu
    assert "trivially" in compressors["note"]
    assert doc["checks"][1]["skipped"].startswith("not available on cpu")


def test_a_check_past_its_limit_is_a_failed_record() -> None:
    rec = runner.isolated("pipelines", "cpu", timeout_s=0.5)
    assert rec["name"] == "pipelines" and rec["ok"] is False
    assert "timed out after" in rec["error"], rec
    assert rec["seconds"] < 30  # killed, not waited for
    assert runner.line(rec).startswith("gpu_check: FAIL pipelines")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")  # a zombie is dead (PID 1 may not reap it at once)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="walks /proc (Linux)")
def test_bounded_run_kills_a_grandchild_in_its_own_session() -> None:
    """Past the limit every process the command started dies, even one that left the
    command's session (as torchrun's launch inside a check does)."""
    code = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'],"
        " start_new_session=True)\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    done = common.run_bounded([sys.executable, "-c", code], timeout_s=3)
    assert done.timed_out
    grandchild = int(done.stdout.split()[0])
    deadline = time.monotonic() + 10
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(grandchild)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--device", "tpu"], "--device 'tpu' is not supported; valid: cuda, cpu"),
        (["--device", "cpu", "--checks", "train,nope"], "unknown check(s) ['nope']"),
    ],
)
def test_bad_arguments_are_refused_before_any_work(capsys, tmp_path, args, message) -> None:
    out = tmp_path / "never.json"
    assert runner.main([*args, "--out", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
def test_cuda_without_a_gpu_is_refused(capsys) -> None:
    assert runner.main(["--device", "cuda"]) == 2
    assert "no CUDA device is visible; use --device cpu" in capsys.readouterr().err


def test_sync_counter_counts_python_warnings_and_cpp_lines(monkeypatch) -> None:
    """The counter with CUDA's calls stubbed: two warnings from Python and one line written
    by C++ to the process's stderr are three syncs, each under its source."""
    modes: list[object] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)

    def run() -> None:
        for _ in range(2):
            warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
        warnings.warn("an unrelated warning", UserWarning, stacklevel=1)
        os.write(2, b"Warning: called a synchronizing CUDA operation (function item)\n")

    got = syncs.count_syncs(run, torch.device("cpu"))
    assert got["syncs"] == 3, got
    assert modes == ["warn", 0]  # switched on, and off again
    assert sorted(got["sites"].values()) == [1, 2]
    assert any(site.startswith("(C++ stderr)") for site in got["sites"])
