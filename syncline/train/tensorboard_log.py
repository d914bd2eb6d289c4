"""``--tensorboard``: the recorded scalars, also written for TensorBoard (rank 0 only).

metrics.jsonl and summary.json stay the source of truth; this is a view of the same records
for the tool people already watch runs with. The scalars of a record are a pure function
(:func:`scalars`), tested without the writer; :class:`TensorBoardLog` only hands them to the
``tensorboard`` package's writer (through ``torch.utils.tensorboard``, which needs it).
Importing this module loads neither torch nor tensorboard, so the command line can check
for the package before any process starts (:func:`check_available`).
"""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path
from typing import Any

from syncline.errors import ConfigError
from syncline.train.metrics import StepRecord

__all__ = ["TensorBoardLog", "check_available", "scalars", "summary_scalars"]

#: the sub-directory of the run directory that holds the event files
SUBDIR = "tensorboard"


def check_available() -> None:
    """Raises ConfigError, naming the fix, when the ``tensorboard`` package is missing."""
    if find_spec("tensorboard") is None:
        raise ConfigError(
            "--tensorboard needs the tensorboard package, which is not installed: "
            "pip install 'syncline[tensorboard]', or leave out --tensorboard (metrics.jsonl "
            "has every value)"
        )


def scalars(record: StepRecord, *, pipelined: bool) -> dict[str, tuple[int, float]]:
    """``{tag: (step, value)}`` of one metrics record.

    A pipeline's bytes on the wire are the rate over an interval that ended at an earlier
    step (``record.wire_steps``, see the trainer's ``_WireMeter``), so they are written at
    that step; a pipeline measures no exposed communication per step (its idle time is the
    bubble, :func:`summary_scalars`).
    """
    step = record.step
    out: dict[str, tuple[int, float]] = {
        "loss/train": (step, record.loss),
        "lr": (step, record.lr),
        "throughput/samples_per_s": (step, record.samples_per_s),
        "throughput/tokens_per_s": (step, record.tokens_per_s),
        "time/step_s": (step, record.step_s),
    }
    if record.val_loss is not None:
        out["loss/validation"] = (step, record.val_loss)
    if record.val_ppl is not None:
        out["perplexity/validation"] = (step, record.val_ppl)
    if record.wire_bytes is not None:
        at = record.wire_steps[1] if record.wire_steps else step
        out["comm/wire_bytes_per_step"] = (at, float(record.wire_bytes))
        for kind, value in (record.wire_split or {}).items():
            out[f"comm/wire_bytes_per_step/{kind}"] = (at, float(value))
    if not pipelined:
        out["comm/exposed_s"] = (step, record.exposed_comm_s)
    return out


def summary_scalars(summary: dict[str, Any]) -> dict[str, float]:
    """The run's end figures worth a point on a chart: a pipeline's bubble fraction (idle
    share of the traced steps) and the best validation loss."""
    keys = {
        "pipeline/bubble_fraction": "traced_bubble_fraction",
        "loss/best_validation": "best_val_loss",
    }
    return {tag: float(summary[key]) for tag, key in keys.items() if summary.get(key) is not None}


class TensorBoardLog:
    """Writes records' scalars to ``RUN_DIR/tensorboard`` (see :meth:`open`).

    Args:
        writer: a ``SummaryWriter`` (or anything with ``add_scalar``, ``flush``, ``close``).
        pipelined: whether the records come from a pipeline (see :func:`scalars`).
    """

    def __init__(self, writer: Any, *, pipelined: bool) -> None:
        self._writer, self._pipelined = writer, pipelined

    @classmethod
    def open(cls, run_dir: Path, *, pipelined: bool) -> TensorBoardLog:
        """A log writing event files under ``run_dir / "tensorboard"``."""
        from torch.utils.tensorboard import SummaryWriter

        return cls(SummaryWriter(log_dir=str(run_dir / SUBDIR)), pipelined=pipelined)

    def add(self, record: StepRecord) -> None:
        """Write one record's scalars (flushed, so a live TensorBoard sees them at once)."""
        for tag, (step, value) in scalars(record, pipelined=self._pipelined).items():
            self._writer.add_scalar(tag, value, step)
        self._writer.flush()

    def close(self, summary: dict[str, Any], last_step: int) -> None:
        """Write the summary's scalars at ``last_step`` and close the event file."""
        for tag, value in summary_scalars(summary).items():
            self._writer.add_scalar(tag, value, last_step)
        self._writer.close()
