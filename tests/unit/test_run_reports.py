"""What is read and written around a run, without training: TensorBoard's scalars of a
record, the refusal of ``--tensorboard`` without the package, and ``syncline report``'s
reading of run directories, its table, its figure and its one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from syncline.cli.main import main
from syncline.train.metrics import StepRecord
from syncline.train.runs import comparison_table, load_run
from syncline.train.tensorboard_log import scalars, summary_scalars


def _record(step: int, **extra: object) -> StepRecord:
    base = dict(step=step, loss=2.0, lr=1e-3, step_s=0.5, samples_per_s=64.0,
                tokens_per_s=4096.0, wire_bytes=1000, collectives=1, exposed_comm_s=0.01,
                elapsed_s=1.0 + step)  # fmt: skip
    return StepRecord(**{**base, **extra})  # type: ignore[arg-type]


def test_scalars_of_data_parallel_and_pipeline_records() -> None:
    dp = scalars(_record(4, val_loss=1.5, val_ppl=4.48), pipelined=False)
    assert dp["loss/train"] == (4, 2.0) and dp["loss/validation"] == (4, 1.5)
    assert dp["perplexity/validation"] == (4, 4.48) and dp["comm/exposed_s"] == (4, 0.01)
    assert dp["lr"] == (4, 1e-3) and dp["comm/wire_bytes_per_step"] == (4, 1000.0)
    split = {"activations": 600, "gradients": 400, "reduce": 0}
    pp = scalars(_record(9, wire_split=split, wire_steps=[0, 4]), pipelined=True)
    assert "comm/exposed_s" not in pp and "loss/validation" not in pp
    assert pp["comm/wire_bytes_per_step"] == (4, 1000.0)  # the rate of steps 1..4, at 4
    assert pp["comm/wire_bytes_per_step/activations"] == (4, 600.0)
    assert "comm/wire_bytes_per_step" not in scalars(_record(0, wire_bytes=None), pipelined=True)
    end = summary_scalars({"traced_bubble_fraction": 0.25, "best_val_loss": 1.5, "x": 1})
    assert end == {"pipeline/bubble_fraction": 0.25, "loss/best_validation": 1.5}


def test_tensorboard_flag_without_the_package_stops_before_launch(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    monkeypatch.setattr("syncline.train.tensorboard_log.find_spec", lambda name: None)
    run = tmp_path / "run"
    assert main(["train", "--tensorboard", "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "needs the tensorboard package" in err
    assert not run.exists()  # nothing was started or written


def _write_run(path: Path, *, pipeline: bool, finished: bool = True) -> Path:
    path.mkdir(parents=True)
    config = {"model": "gpt", "data": None, "nproc_per_node": 2, "nnodes": 1,
              "pipeline_stages": 2 if pipeline else 1, "schedule": "1f1b" if pipeline else None,
              "microbatches": 4 if pipeline else None, "compression": "none"}  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    records = [
        {"step": s, "loss": 3.0 - 0.1 * s, "samples_per_s": 50.0 + s, "tokens_per_s": 3200.0,
         "wire_bytes": None if pipeline and s == 0 else 2048, "elapsed_s": 0.5 * s,
         "val_loss": 3.1 - 0.1 * s if s % 5 == 0 else None,
         "wire_steps": [s - 5, s] if pipeline and s else None}
        for s in range(0, 11)
    ]  # fmt: skip
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if finished:
        summary = {"median_samples_per_s": 55.0, "median_tokens_per_s": 3200.0,
                   "wire_bytes_per_step": 2048, "best_val_loss": 2.1, "data": "stdlib",
                   "peak_rss_bytes_per_rank": [300 << 20, 310 << 20]}  # fmt: skip
        if pipeline:
            summary["memory"] = {"0": {"peak_activation_bytes": 4 << 20},
                                 "1": {"peak_activation_bytes": 2 << 20}}  # fmt: skip
        (path / "summary.json").write_text(json.dumps(summary))
    return path


def test_report_table_and_figure_of_two_runs(tmp_path: Path, capsys) -> None:
    dp = _write_run(tmp_path / "dp", pipeline=False)
    pp = _write_run(tmp_path / "pp", pipeline=True, finished=False)
    table = comparison_table([load_run(dp), load_run(pp)])
    header, _, first, second, note = table.splitlines()
    assert header.split()[:4] == ["run", "model", "layout", "steps"]
    assert first.split()[1:5] == ["gpt/stdlib", "dp", "x2", "11"] and "2.1000" in first
    assert "1f1b 2x1 m=4" in second and "11*" in second and note.startswith("* no summary")
    out = tmp_path / "cmp.png"
    assert main(["report", str(dp), str(pp), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert capsys.readouterr().out.startswith(header)


@pytest.mark.parametrize(
    ("make", "args", "match"),
    [
        (None, ["missing"], "missing: not a run directory (no such directory)"),
        ("empty", ["empty"], "no config.json; not a syncline run directory"),
        ("nometrics", ["nometrics"], "no metrics.jsonl"),
        ("nolines", ["nolines"], "no records yet"),
        ("badjson", ["badjson"], "config.json: cannot be read"),
        ("empty", ["empty", "--out", "x.svg"], "valid: a path ending in .png"),
    ],
)
def test_bad_report_input_is_one_line_and_exit_2(
    tmp_path: Path, monkeypatch, capsys, make, args, match
) -> None:
    monkeypatch.chdir(tmp_path)
    if make:
        Path(make).mkdir()
    if make in ("nometrics", "nolines"):
        Path(make, "config.json").write_text("{}")
    if make == "nolines":
        Path(make, "metrics.jsonl").write_text("\n")
    if make == "badjson":
        Path(make, "config.json").write_text("{")
    assert main(["report", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("syncline report: error: ") and "\n" not in err and match in err
    assert not Path("report.png").exists()
