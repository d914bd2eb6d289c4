"""The pure layers must not load torch: planners and schedules run with no cluster at all."""

from __future__ import annotations

import subprocess
import sys

import pytest

PURE = [
    "syncline",
    "syncline.config",
    "syncline.errors",
    "syncline.dp.buckets",
    "syncline.comm.topology",
    "syncline.schedule",
    "syncline.launch.netns",
    "syncline.partition",
]


@pytest.mark.parametrize("module", PURE)
def test_pure_module_does_not_import_torch(module: str) -> None:
    code = f"import sys, {module}; assert 'torch' not in sys.modules, 'torch was loaded'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_only_comm_imports_torch_distributed() -> None:
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2] / "syncline"
    offenders = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(("comm/", "launch/", "testing/")):
            continue
        text = path.read_text()
        if "torch.distributed" in text and "import torch.distributed" in text:
            offenders.append(rel)
    assert offenders == []
