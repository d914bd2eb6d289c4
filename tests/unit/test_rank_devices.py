"""One device per rank, GPU-aware launch defaults, device-aware memory and checkpoints read
on the CPU (issue 33), checked on a CPU machine that plays a GPU node where it must.

A node's GPUs are played by replacing ``torch.cuda.is_available``/``device_count`` (and
``syncline.launch.devices.visible_gpus`` for the CLI); the ``meta`` device stands in for a
device that is not the CPU where tensors must move.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import syncline
from syncline.cli.main import build_parser, config_from_args, main
from syncline.comm.device import local_device
from syncline.errors import ConfigError
from syncline.launch.devices import default_nproc_per_node, resolved_backend
from syncline.train.common import rank_backend_and_device, rank_memory
from syncline.train.config import TrainConfig
from syncline.train.metrics import memory_summary
from syncline.train.runs import peak_memory


def _gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> list[torch.device]:
    """Play a node with ``count`` GPUs; returns the devices ``set_device`` was given."""
    chosen: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr("syncline.launch.devices.visible_gpus", lambda: count)
    return chosen


@pytest.mark.parametrize(
    ("gpus", "local_rank", "ordinal"), [(1, 0, 0), (1, 3, 0), (4, 3, 3), (4, 5, 1), (8, 7, 7)]
)
def test_a_rank_computes_on_its_local_rank_modulo_the_visible_gpus(
    monkeypatch: pytest.MonkeyPatch, gpus: int, local_rank: int, ordinal: int
) -> None:
    """One visible GPU per rank (a scheduler's CUDA_VISIBLE_DEVICES) makes cuda:LOCAL_RANK
    invalid for every rank but the first: the ordinal wraps."""
    _gpus(monkeypatch, gpus)
    assert local_device("cuda", local_rank) == torch.device("cuda", ordinal)
    assert local_device("cpu", local_rank) == torch.device("cpu")


def test_the_worker_picks_backend_and_device_and_makes_it_current(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    chosen = _gpus(monkeypatch, 2)
    assert rank_backend_and_device(TrainConfig(), 3) == ("nccl", torch.device("cuda", 1))
    assert chosen == [torch.device("cuda", 1)]
    assert rank_backend_and_device(TrainConfig(backend="gloo"), 3) == ("gloo", torch.device("cpu"))
    assert chosen == [torch.device("cuda", 1)]  # a CPU rank sets no CUDA device
    _gpus(monkeypatch, 0)
    assert rank_backend_and_device(TrainConfig(), 1) == ("gloo", torch.device("cpu"))
    with pytest.raises(ConfigError, match="no CUDA device is visible"):
        rank_backend_and_device(TrainConfig(backend="nccl"), 0)


@pytest.mark.parametrize(
    ("backend", "gpus", "resolved", "nproc"),
    [
        ("auto", 0, "gloo", 2),
        ("auto", 1, "nccl", 1),
        ("auto", 8, "nccl", 8),
        ("gloo", 8, "gloo", 2),
        ("nccl", 4, "nccl", 4),
        ("nccl", 0, "nccl", 2),  # then refused: more ranks than GPUs
    ],
)
def test_ranks_per_node_default_to_one_per_gpu_under_nccl(
    backend: str, gpus: int, resolved: str, nproc: int
) -> None:
    assert resolved_backend(backend, gpus) == resolved
    assert default_nproc_per_node(backend, gpus) == nproc


def _config(*args: str) -> TrainConfig:
    return config_from_args(build_parser().parse_args(["train", "--run-dir", "unused", *args]))


def test_the_cli_starts_one_rank_per_gpu_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 4)
    assert _config().nproc_per_node == 4
    assert _config("--nproc-per-node", "2").nproc_per_node == 2
    assert _config("--backend", "gloo").nproc_per_node == 2
    with pytest.raises(ConfigError, match=r"nproc_per_node=8 is more than .* 4 visible GPU"):
        _config("--nproc-per-node", "8")
    _gpus(monkeypatch, 0)
    assert _config().nproc_per_node == 2


@pytest.mark.parametrize(("gpus", "backend"), [(2, "auto"), (0, "nccl"), (2, "nccl")])
def test_emulated_network_under_nccl_is_refused_before_anything_starts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path,
    gpus: int, backend: str,
) -> None:  # fmt: skip
    """Every emulated node runs one rank (all LOCAL_RANK 0, all on cuda:0) and NCCL ignores
    GLOO_SOCKET_IFNAME: refused, naming why and what is valid, before root is needed."""
    _gpus(monkeypatch, gpus)
    run = tmp_path / "run"
    args = ["train", "--emulate-network", "100mbit", "--backend", backend, "--run-dir", str(run)]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "emulate_network='100mbit' with backend nccl" in err
    assert "GLOO_SOCKET_IFNAME" in err and "valid: --backend gloo" in err
    assert not run.exists()
    with pytest.raises(ConfigError, match="with backend nccl"):
        TrainConfig(emulate_network="100mbit", backend="nccl")


def test_summary_memory_keys_on_the_cpu_and_on_gpus() -> None:
    mine = rank_memory(torch.device("cpu"))
    assert mine["kind"] == "rss" and mine["bytes"] == mine["rss_bytes"] > 10 << 20
    assert mine["reserved_bytes"] is None
    cpu = memory_summary([mine, mine])
    assert cpu == {
        "peak_memory_bytes_per_rank": [mine["bytes"]] * 2,
        "peak_memory_kind": "rss",
        "peak_rss_bytes_per_rank": [mine["bytes"]] * 2,
    }
    gpu = {"kind": "cuda_max_allocated", "bytes": 3 << 30, "reserved_bytes": 4 << 30,
           "rss_bytes": 2 << 30}  # fmt: skip
    summary = memory_summary([gpu, {**gpu, "bytes": 5 << 30}])
    assert summary == {
        "peak_memory_bytes_per_rank": [3 << 30, 5 << 30],
        "peak_memory_kind": "cuda_max_allocated",
        "peak_rss_bytes_per_rank": [2 << 30, 2 << 30],
        "peak_memory_reserved_bytes_per_rank": [4 << 30, 4 << 30],
    }
    assert peak_memory(summary) == ([3 << 30, 5 << 30], "cuda_max_allocated")
    assert peak_memory({"peak_rss_bytes_per_rank": [1, 2]}) == ([1, 2], "rss")  # older runs


def test_restored_compressor_state_lands_on_the_ranks_device() -> None:
    """A checkpoint is read into CPU tensors; the compressor's residuals go to the device
    of the gradients they are added to (``meta`` for a GPU), the RNG states stay on the CPU."""
    from syncline.train.state import _local_entries, _local_state

    state = {"residual": torch.ones(3), "nested": [{"q": torch.zeros(2, 2)}], "step": 4}
    before = torch.get_rng_state()
    got = _local_entries(1, state)
    torch.rand(5)  # moves the generator on; restoring puts it back
    local = _local_state(got, 1, torch.device("meta"))
    assert torch.equal(torch.get_rng_state(), before)
    comp = local["compression"]
    assert comp["residual"].is_meta and comp["nested"][0]["q"].is_meta and comp["step"] == 4
    assert comp["nested"][0]["q"].shape == (2, 2)


def _calls_without_map_location(path: Path) -> list[int]:
    """Lines of ``torch.load(...)`` calls in ``path`` that do not pass ``map_location``."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        func = node.func
        is_torch_load = (
            func.attr == "load" and isinstance(func.value, ast.Name) and func.value.id == "torch"
        )
        if is_torch_load and "map_location" not in {k.arg for k in node.keywords}:
            lines.append(node.lineno)
    return lines


def test_every_torch_load_says_where_tensors_land() -> None:
    """Without ``map_location`` a CUDA tensor is restored onto the GPU ordinal it was saved
    from: another rank's GPU in this process, or no GPU at all on a CPU-only host."""
    root = Path(syncline.__file__).parent
    found = {}
    for path in sorted(root.rglob("*.py")):
        lines = _calls_without_map_location(path)
        if lines:
            found[path.relative_to(root).as_posix()] = lines
    assert found == {}
