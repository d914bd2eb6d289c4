"""Dependencies as a library declares them: torch with a lower bound only, the plots,
TensorBoard and data sets behind extras, each missing extra refused in one line naming it
before anything starts, and ``import syncline`` loading none of them."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from syncline import extras
from syncline.cli.main import main
from syncline.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _name(requirement: str) -> str:
    """The distribution name of a requirement string (``torch>=2.13`` -> ``torch``)."""
    for i, ch in enumerate(requirement):
        if ch in "<>=!~[; ":
            return requirement[:i]
    return requirement


def test_torch_has_a_lower_bound_and_no_upper_one() -> None:
    deps = PROJECT["dependencies"]
    assert sorted(_name(d) for d in deps) == ["numpy", "torch"]
    (torch,) = [d for d in deps if _name(d) == "torch"]
    assert torch == "torch>=2.13"  # the oldest release the suite is run on (README)


def test_the_extras_hold_what_syncline_extras_names() -> None:
    optional = PROJECT["optional-dependencies"]
    for extra, pairs in extras.EXTRAS.items():
        assert sorted(_name(r) for r in optional[extra]) == sorted(d for _, d in pairs), extra
    assert optional["all"] == ["syncline[plot,tensorboard,data]"]
    assert "syncline[all]" in optional["dev"]


def test_the_dev_environment_pins_the_tested_torch() -> None:
    lines = (REPO / "constraints.txt").read_text().splitlines()
    assert "torch==2.13.0" in lines
    assert "-c constraints.txt" in (REPO / "scripts" / "env.sh").read_text()


def test_missing_line_names_feature_package_and_extra() -> None:
    assert extras.missing_line("--data digits", "sklearn") == (
        "--data digits needs scikit-learn, which is not installed: pip install 'syncline[data]'"
    )
    with pytest.raises(KeyError):
        extras.missing_line("x", "numpy")


def test_require_refuses_only_a_missing_package(monkeypatch) -> None:
    extras.require("--plot", "matplotlib")  # installed in the dev environment
    monkeypatch.setattr(extras, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"^--plot needs matplotlib.*syncline\[plot\]'$"):
        extras.require("--plot", "matplotlib")


@pytest.mark.parametrize(
    ("args", "module", "line"),
    [
        (["--model", "cnn"], "sklearn", "--data digits needs scikit-learn"),
        (["--model", "cnn", "--data", "images:."], "PIL", "--data images:. needs pillow"),
    ],
)
def test_a_data_set_without_its_package_stops_before_launch(
    tmp_path: Path, monkeypatch, capsys, args, module, line
) -> None:
    real = extras.find_spec
    monkeypatch.setattr(extras, "find_spec", lambda name: None if name == module else real(name))
    run = tmp_path / "run"
    assert main(["train", *args, "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and line in err and "pip install 'syncline[data]'" in err
    assert not run.exists()


def test_report_without_matplotlib_stops_before_reading(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.setattr(extras, "find_spec", lambda name: None)
    assert main(["report", str(tmp_path / "nothing"), "--out", str(tmp_path / "r.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "syncline report: error: syncline report (its figure) needs matplotlib, which is not "
        "installed: pip install 'syncline[plot]'"
    )


def test_without_matplotlib_no_plot_is_drawn(tmp_path: Path, monkeypatch) -> None:
    from syncline.train import metrics, plots

    monkeypatch.setattr(extras, "find_spec", lambda name: None)
    assert metrics.plot_loss([], tmp_path / "loss.png", "t") is None
    assert plots.plot_schedule(None, tmp_path / "s.png", "t") is None  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("syncline 0.1.0 (torch 2.") and out.endswith(")")


def test_import_syncline_loads_no_extra() -> None:
    code = (
        "import sys, syncline, syncline.cli.main, syncline.train.config\n"
        "from syncline import DataParallel, Pipeline\n"
        "loaded = sorted(m for m in ('matplotlib', 'sklearn', 'tensorboard', 'PIL', "
        "'tokenizers') if m in sys.modules)\n"
        "assert loaded == [], loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
