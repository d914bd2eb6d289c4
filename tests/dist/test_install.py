"""syncline installs beside the user's stack: its wheel, built from this checkout, goes into a
fresh virtual environment that already holds torch, changes nothing installed there and
brings none of the extras; ``import syncline`` loads none of them, and ``syncline --version``
and a 2-step ``syncline train`` run there.

The environment gets a real torch (``pip install torch==<this torch>``, the CPU wheel on this
machine's disk, about a minute and 1 GB, removed afterwards): pointing a ``.pth`` file at the
dev environment instead would be faster but would also show pip that environment's
matplotlib, scikit-learn and tensorboard, which is what this test must see absent.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
EXTRAS = ("matplotlib", "scikit-learn", "tensorboard", "pillow", "tokenizers")


def _run(*argv: str | Path, cwd: Path | None = None, timeout: float = 600) -> str:
    """Run with no PYTHONPATH (so the checkout is not what imports); stdout, or fail."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONUNBUFFERED"] = "1"
    res = subprocess.run(
        [str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert res.returncode == 0, f"{argv}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    return res.stdout


def _installed(python: Path) -> dict[str, str]:
    listed = json.loads(_run(python, "-m", "pip", "list", "--format", "json"))
    return {d["name"].lower(): d["version"] for d in listed}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """syncline's wheel, built from a copy of the checkout (no build files left in it)."""
    src = tmp_path_factory.mktemp("src")
    shutil.copytree(
        REPO / "syncline", src / "syncline", ignore=shutil.ignore_patterns("__pycache__")
    )
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    out = tmp_path_factory.mktemp("wheel")
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", out, src)
    (built,) = out.glob("syncline-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Iterator[Path]:
    """A fresh environment holding the torch these tests run on, and numpy: a user's stack."""
    root = tmp_path_factory.mktemp("venv")
    _run(sys.executable, "-m", "venv", root / "env")
    python = root / "env" / "bin" / "python"
    _run(python, "-m", "pip", "install", "--quiet", f"torch=={torch.__version__}", "numpy")
    yield python
    shutil.rmtree(root, ignore_errors=True)  # about 1 GB; pytest keeps its last temp dirs


def test_the_wheel_installs_beside_torch_and_runs(wheel: Path, venv: Path, tmp_path: Path):
    before = _installed(venv)
    assert before["torch"] == torch.__version__ and not any(e in before for e in EXTRAS)
    report = tmp_path / "report.json"
    _run(venv, "-m", "pip", "install", "--dry-run", "--quiet", "--report", report, wheel)
    planned = json.loads(report.read_text())["install"]
    names = {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in planned}
    assert names == {"syncline": "0.1.0"}, names  # nothing of torch changes, no extra comes

    _run(venv, "-m", "pip", "install", "--quiet", wheel)
    after = _installed(venv)
    assert after == {**before, "syncline": "0.1.0"}

    code = (
        "import sys, syncline, syncline.cli.main, syncline.train.config\n"
        "from syncline import DataParallel, Pipeline\n"
        "loaded = [m for m in ('matplotlib', 'sklearn', 'tensorboard', 'PIL', 'tokenizers')\n"
        "          if m in sys.modules]\n"
        "assert loaded == [], loaded\n"
        "print(syncline.__file__)\n"
    )
    where = _run(venv, "-c", code, cwd=tmp_path).strip()
    assert where.startswith(str(venv.parent.parent)), where  # the installed copy

    syncline = venv.parent / "syncline"
    version = _run(syncline, "--version").strip()
    assert version.startswith(f"syncline 0.1.0 (torch {torch.__version__}, Python 3."), version

    run = tmp_path / "run"
    tiny = ["--n-layer", "1", "--n-embd", "32", "--seq-len", "16", "--batch-size", "4"]
    out = _run(
        syncline,
        "train",
        "--steps",
        "2",
        "--log-every",
        "1",
        "--eval-every",
        "0",
        "--sample-tokens",
        "0",
        *tiny,
        "--run-dir",
        run,
        cwd=tmp_path,
    )
    assert "syncline train: no plots: loss.png needs matplotlib" in out
    assert "pip install 'syncline[plot]'" in out and "summary: 2 steps on 2 ranks" in out
    assert (run / "checkpoint.pt").is_file() and not (run / "loss.png").exists()
    digits = subprocess.run(
        [syncline, "train", "--model", "cnn", "--run-dir", tmp_path / "cnn"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert digits.returncode == 2
    assert digits.stderr.strip() == (
        "syncline train: error: --data digits needs scikit-learn, which is not installed: "
        "pip install 'syncline[data]'"
    )
