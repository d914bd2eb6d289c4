"""``syncline report RUN_DIR [RUN_DIR ...]``: compare finished (or running) runs.

Reads each run directory (config.json, metrics.jsonl, summary.json), prints one table row
per run and draws them side by side into one PNG, so that comparing two configurations is
one command. Every directory is read before anything is drawn: a bad one ends the command
with one line naming it, and no partial figure.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from syncline.errors import ConfigError
from syncline.extras import require

__all__ = ["REPORT_DOC", "add_report_options", "cmd_report"]

REPORT_DOC = """\
Compare runs of syncline train: prints a table (model and data, layout, steps, final and
best validation loss, samples/s, tokens/s, bytes on the wire per step, peak memory, time)
and draws one PNG with the loss by step and by wall time (training and validation),
throughput, bytes on the wire per step, peak memory per rank and, for pipelines, stashed
activations per stage.

Example: syncline report runs/dp runs/pipeline --out compare.png
"""


def add_report_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories to compare")
    parser.add_argument(
        "--out",
        default="report.png",
        metavar="PNG",
        help="where the figure goes (default: report.png in the current directory)",
    )


def cmd_report(ns: argparse.Namespace) -> int:
    """Print the table and write the figure; exit code 0.

    Raises:
        ConfigError: a directory that is no run directory, or an output path that is not a
            .png in an existing directory.
    """
    from syncline.train.runs import comparison_table, load_run

    out = Path(ns.out)
    if out.suffix.lower() != ".png":
        raise ConfigError(f"--out {ns.out}: the figure is a PNG; valid: a path ending in .png")
    if not out.parent.is_dir():
        raise ConfigError(f"--out {ns.out}: directory {out.parent} does not exist")
    require("syncline report (its figure)", "matplotlib")
    runs = [load_run(path) for path in ns.runs]
    print(comparison_table(runs), flush=True)
    from syncline.train.report import plot_report

    plot_report(runs, out, title=" vs ".join(r.label for r in runs))
    print(f"figure: {out}", flush=True)
    return 0
