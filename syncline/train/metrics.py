"""Per-step metrics: a JSONL file while training, a summary and a loss-curve PNG at the end."""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from syncline.extras import installed


@dataclass(frozen=True)
class StepRecord:
    step: int
    loss: float
    lr: float
    step_s: float
    samples_per_s: float
    tokens_per_s: float
    wire_bytes: int | None
    collectives: int
    exposed_comm_s: float
    elapsed_s: float
    #: pipelines: ``wire_bytes`` by what was sent (activations, gradients, reduce)
    wire_split: dict[str, int] | None = None
    #: pipelines: ``[a, b]``: the wire figures are the rate over steps ``a+1 .. b`` (they
    #: lag one record, so that logging never makes the stages wait for each other)
    wire_steps: list[int] | None = None
    #: the held-out loss after this step's update (steps that validate only)
    val_loss: float | None = None
    #: a language model's validation perplexity, ``exp(val_loss)``
    val_ppl: float | None = None


def timed_record(
    step: int,
    loss: float,
    lr: float,
    *,
    samples: int,
    tokens_per_sample: int,
    step_s: float,
    run_started: float,
    wire_bytes: int | None = 0,
    collectives: int = 0,
    exposed_comm_s: float = 0.0,
    wire_split: dict[str, int] | None = None,
    wire_steps: list[int] | None = None,
    val_loss: float | None = None,
    val_ppl: float | None = None,
) -> StepRecord:
    """The record of a step that took ``step_s`` seconds, timed by a
    :class:`~syncline.comm.device.Stopwatch` on the rank's device (CUDA events on a GPU,
    whose work is asynchronous: the host's clock would time the kernel launches), in a run
    that began at ``run_started`` (``time.perf_counter()``: wall-clock, for the elapsed time
    and the ETA); both training loops (data parallel, pipeline) log through it, so the rates
    mean the same."""
    dt = step_s
    now = time.perf_counter()
    return StepRecord(
        step=step,
        loss=loss,
        lr=lr,
        step_s=dt,
        samples_per_s=samples / dt,
        tokens_per_s=samples * tokens_per_sample / dt,
        wire_bytes=wire_bytes,
        collectives=collectives,
        exposed_comm_s=exposed_comm_s,
        elapsed_s=now - run_started,
        wire_split=wire_split,
        wire_steps=wire_steps,
        val_loss=val_loss,
        val_ppl=val_ppl,
    )


class MetricsLog:
    """Appends one JSON object per recorded step; flushes so a crash keeps what was written."""

    def __init__(self, path: Path, resume_at: int | None = None) -> None:
        """``resume_at``: a resumed run's first step; the records of earlier steps are read
        back (the summary covers the whole run), later ones (logged after the checkpoint,
        before the failure) dropped, as the resumed run logs them again."""
        self.path = path
        self.records: list[StepRecord] = []
        if resume_at and path.is_file():
            lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            # the guard's event lines ({"guard_event": ...}) are kept as they were, in place
            kept = [d for d in lines if d.get("guard_event", d).get("step", 0) < resume_at]
            self.records = [StepRecord(**d) for d in kept if "guard_event" not in d]
            path.write_text("".join(json.dumps(d) + "\n" for d in kept))

    def append(self, record: StepRecord) -> None:
        self.records.append(record)
        with self.path.open("a") as f:
            f.write(json.dumps(asdict(record)) + "\n")


def memory_summary(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """The summary.json keys of every rank's peak memory (``syncline.train.common.rank_memory``),
    in rank order:
    ``peak_memory_bytes_per_rank`` on each rank's device with its ``peak_memory_kind``
    (``cuda_max_allocated`` or ``rss``), ``peak_rss_bytes_per_rank`` (kept for the readers
    of earlier summaries), and on GPUs the caching allocator's peak
    (``peak_memory_reserved_bytes_per_rank``, what ``nvidia-smi`` sees).

    Example:
        >>> peak = {"kind": "rss", "bytes": 5, "reserved_bytes": None, "rss_bytes": 5}
        >>> memory_summary([peak, peak])["peak_memory_bytes_per_rank"]
        [5, 5]
    """
    kinds = sorted({m["kind"] for m in per_rank})
    out: dict[str, Any] = {
        "peak_memory_bytes_per_rank": [m["bytes"] for m in per_rank],
        "peak_memory_kind": kinds[0] if len(kinds) == 1 else ",".join(kinds),
        "peak_rss_bytes_per_rank": [m["rss_bytes"] for m in per_rank],
    }
    if any(m.get("reserved_bytes") is not None for m in per_rank):
        out["peak_memory_reserved_bytes_per_rank"] = [m.get("reserved_bytes") for m in per_rank]
    return out


def summarize(records: list[StepRecord], skip: int = 1) -> dict[str, Any]:
    """Medians over the steady state (the first ``skip`` records include warm-up)."""
    if not records:
        return {}
    steady = records[skip:] or records
    return {
        "steps": records[-1].step + 1,
        "first_loss": records[0].loss,
        "final_loss": records[-1].loss,
        "median_samples_per_s": statistics.median(r.samples_per_s for r in steady),
        "median_tokens_per_s": statistics.median(r.tokens_per_s for r in steady),
        "median_step_s": statistics.median(r.step_s for r in steady),
        "wire_bytes_per_step": statistics.median(
            [r.wire_bytes for r in steady if r.wire_bytes is not None]
            or [r.wire_bytes or 0 for r in records]
        ),
        "collectives_per_step": statistics.median(r.collectives for r in steady),
        "median_exposed_comm_s": statistics.median(r.exposed_comm_s for r in steady),
        "elapsed_s": records[-1].elapsed_s,
        **_validation_summary(records),
    }


def _validation_summary(records: list[StepRecord]) -> dict[str, Any]:
    """The final and the best validation loss (and perplexity), when the run validated."""
    validated = [r for r in records if r.val_loss is not None]
    if not validated:
        return {}
    best = min(validated, key=lambda r: r.val_loss if r.val_loss is not None else math.inf)
    out: dict[str, Any] = {
        "first_val_loss": validated[0].val_loss,
        "final_val_loss": validated[-1].val_loss,
        "best_val_loss": best.val_loss,
        "best_val_step": best.step,
    }
    if best.val_ppl is not None:
        out.update(final_val_ppl=validated[-1].val_ppl, best_val_ppl=best.val_ppl)
    return out


def plot_loss(records: list[StepRecord], path: Path, title: str) -> Path | None:
    """Write the loss curve as a PNG (matplotlib's Agg backend: no display needed); without
    matplotlib (the ``plot`` extra) nothing, and ``None``: the command line said so before
    the run, and metrics.jsonl holds every value the curve would show."""
    if not installed("matplotlib"):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot([r.step for r in records], [r.loss for r in records], lw=1.5, label="training")
    validated = [r for r in records if r.val_loss is not None]
    if validated:
        ax.plot(
            [r.step for r in validated],
            [r.val_loss or 0.0 for r in validated],
            "o-",
            lw=1.5,
            label="validation (held out)",
        )
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
