"""What a real `syncline train` leaves beside metrics.jsonl: TensorBoard event files that the
tensorboard package reads back, a generated sample (data parallel, and through a pipeline's
forward-only passes), and run directories that `syncline report` compares in one PNG.

One short data-parallel run and one 2-stage pipeline run (2 ranks each, the workers' code
in-process: :mod:`tests.zoo.train`) serve every test.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from syncline.cli.main import main
from tests.zoo.train import train

TINY = ["--n-layer", "2", "--n-embd", "32", "--seq-len", "16", "--batch-size", "16"]
COMMON = [*TINY, "--steps", "6", "--eval-every", "3", "--log-every", "2", "--tensorboard"]
SAMPLE = {"dp": 40, "pp": 12}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    """``{"dp": (run dir, stdout), "pp": ...}``."""
    root = tmp_path_factory.mktemp("runs")
    layouts = {"dp": [], "pp": ["--pipeline-stages", "2"]}
    out = {}
    for name, extra in layouts.items():
        run = root / name
        tokens = ["--sample-tokens", str(SAMPLE[name])]
        res = train(*COMMON, *extra, *tokens, "--run-dir", str(run))
        out[name] = (run, res.stdout)
    return out


def _scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def _same(got: list[tuple[int, float]], expected: list[tuple[int, float]]) -> None:
    """The same steps, and the same values up to float32 (event files store float32)."""
    assert [s for s, _ in got] == [s for s, _ in expected]
    assert [v for _, v in got] == pytest.approx([v for _, v in expected], rel=1e-6)


def test_tensorboard_event_files_hold_the_recorded_scalars(runs) -> None:
    common = {"loss/train", "loss/validation", "perplexity/validation", "lr",
              "throughput/samples_per_s", "throughput/tokens_per_s", "comm/wire_bytes_per_step",
              "loss/best_validation"}  # fmt: skip
    dp, pp = _scalars(runs["dp"][0]), _scalars(runs["pp"][0])
    assert common | {"comm/exposed_s"} <= set(dp)
    assert common | {"pipeline/bubble_fraction", "comm/wire_bytes_per_step/activations"} <= set(pp)
    for run, scalars in ((runs["dp"][0], dp), (runs["pp"][0], pp)):
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        _same(scalars["loss/train"], [(r["step"], r["loss"]) for r in records])
        validated = [(r["step"], r["val_loss"]) for r in records if r["val_loss"] is not None]
        _same(scalars["loss/validation"], validated)
        assert [s for s, _ in validated] == [0, 3, 5] and validated[-1][1] < validated[0][1]
    summary = json.loads((runs["pp"][0] / "summary.json").read_text())
    _same(pp["pipeline/bubble_fraction"], [(5, summary["traced_bubble_fraction"])])


def test_a_language_model_prints_and_saves_its_sample(runs) -> None:
    for name, (run, stdout) in runs.items():
        summary = json.loads((run / "summary.json").read_text())
        sample = summary["sample"]
        assert sample["tokens"] == SAMPLE[name] and sample["prompt"]
        assert 0 < len(sample["text"]) <= SAMPLE[name]  # bytes; invalid UTF-8 joins up
        text = (run / "sample.txt").read_text()
        assert text.startswith(f"--- prompt (held out) ---\n{sample['prompt']}\n")
        assert f"--- generated ({SAMPLE[name]} tokens) ---" in stdout
        assert "sample.txt, tensorboard/)" in stdout


def test_summaries_record_each_ranks_peak_memory_on_its_device(runs) -> None:
    """Issue 33: the device's meter (the resident set on the CPU, the CUDA allocator's peak
    on GPUs) beside the resident set that earlier summaries recorded."""
    for run, _ in runs.values():
        summary = json.loads((run / "summary.json").read_text())
        peaks = summary["peak_memory_bytes_per_rank"]
        assert summary["peak_memory_kind"] == "rss" and len(peaks) == 2
        assert peaks == summary["peak_rss_bytes_per_rank"] and min(peaks) > 50 << 20


def test_report_compares_the_two_runs_in_one_png(runs, tmp_path: Path, capsys) -> None:
    out = tmp_path / "compare.png"
    assert main(["report", str(runs["dp"][0]), str(runs["pp"][0]), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = capsys.readouterr().out.splitlines()
    assert "dp x2" in table[2] and "1f1b 2x1 m=4" in table[3]
    assert "peak memory" in table[0] and table[2].split()[-2] == "rss"
    assert table[-1] == f"figure: {out}"
