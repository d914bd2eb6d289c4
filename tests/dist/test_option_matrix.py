"""Every pair of ``syncline train`` options either trains, checkpoints and resumes bit-exact,
or is refused before launch, in one line naming the options.

The cells come from :func:`syncline.testing.matrix.all_pairs` over the registries (a newly
registered optimizer, schedule, compressor or allreduce algorithm joins by itself, as the
toy plug-in's do here). Each cell
is a ``syncline train`` command line, parsed and validated by the command's own code
(:func:`syncline.cli.main.config_from_args`, the one validation pass), then trained by the
workers' own code in-process (:func:`syncline.testing.run_training`; the launcher is tested
elsewhere): 3 steps with a checkpoint at step 2; then a copy of the run directory without
what came after that checkpoint (a run killed after it) continues, by ``--resume`` or as a
worker restarted by ``--max-restarts``, and must end with the same model, optimizer and
compressor state, bit for bit, and the same last loss. A refusal anywhere but the validation
pass, or any failure once training started, fails the cell.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from syncline.cli.main import build_parser, config_from_args
from syncline.cli.options import values_from
from syncline.dp.registry import COMPRESSORS
from syncline.errors import ConfigError
from syncline.testing.matrix import Cell, all_pairs, train_dimensions
from syncline.testing.training import run_training
from syncline.train.checkpoint import load_checkpoint
from syncline.train.config import TrainConfig
from syncline.train.preflight import prepare_run_dir
from tests.plugins import toy_plugin_registered
from tests.zoo.exact import assert_exact

pytestmark = pytest.mark.slow

# The toy plug-in's compressor, schedule and allreduce join the matrix as a user's would.
# It is registered only while the cells are chosen and while each cell runs, and the
# registries are left as they were found (other tests count the built-in entries).
TOY = "tests.plugins.toy_plugin"
PLUGIN = ["--plugin", TOY]


BASE = ["--seq-len", "16", "--batch-size", "8", "--steps", "3", "--checkpoint-every", "2"]
BASE += ["--keep-checkpoints", "2", "--log-every", "1", "--warmup-steps", "1", "--timeout", "60"]
GPT = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2"]
SPLIT = ["--model", "tests.zoo.models:split_lm", "--data", "stdlib", "--model-option", "width=32"]
SPLIT += ["--split-points", "body"]
#: a spec of each built-in compressor that acts within 3 steps (warm-up of 1 dense step)
EXAMPLES = {"csc": "csc:0.05:warmup=1", "topk": "topk:0.05", "powersgd": "powersgd:2:warmup=1"}
#: a spec of each built-in sync whose replicas are apart at the step-2 checkpoint
SYNC_EXAMPLES = {"localsgd": "localsgd:2", "diloco": "diloco:3"}


#: the options (config fields) each dimension sets: a refusal names those in conflict
OPTIONS = {
    "optimizer": ("optimizer",),
    "layout": ("pipeline_stages", "schedule", "split_points"),
    "ranks": ("nproc_per_node",),
    "precision": ("precision",),
    "compression": ("compression",),
    "allreduce": ("allreduce", "ranks_per_node"),
    "sync": ("sync",),
    "continuation": ("resume", "max_restarts"),
    "validation": ("eval_every", "sample_tokens"),
}


def _spec(name: str) -> str:
    entry = COMPRESSORS.get(name)
    return EXAMPLES.get(name, entry.name if entry.argument is None else f"{name}:0.05")


def _parts(cell: Cell, run_dir: Path | str) -> list[tuple[str, ...]]:
    """The arguments of a cell's first launch in groups, each set by the base or by one or two
    dimensions (the generator parses each group once: thousands of candidates share them)."""
    layout = cell["layout"]
    if layout == "dp":
        shape = tuple(GPT)
    elif layout == "split":
        shape = (*SPLIT, "--pipeline-stages", "2")
    else:
        shape = (*GPT, "--pipeline-stages", "2", "--schedule", layout)
    parts = [
        (*BASE, *PLUGIN, "--run-dir", str(run_dir)),
        ("--optimizer", cell["optimizer"]),
        ("--nproc-per-node", cell["ranks"]),
        ("--precision", cell["precision"]),
        ("--compression", _spec(cell["compression"])),
        ("--allreduce", cell["allreduce"]),
        ("--sync", SYNC_EXAMPLES.get(cell["sync"], cell["sync"])),
        shape,
    ]
    if cell["allreduce"] != "flat":  # two nodes
        parts.append(("--ranks-per-node", str(int(cell["ranks"]) // 2)))
    if cell["continuation"] == "restart":
        parts.append(("--max-restarts", "1"))
    validate = cell["validation"] == "on"
    parts.append(
        ("--eval-every", "2" if validate else "0", "--sample-tokens", "4" if validate else "0")
    )
    return parts


def command(cell: Cell, run_dir: Path | str) -> list[str]:
    """The ``syncline train`` arguments of a cell's first launch."""
    return ["train", *itertools.chain.from_iterable(_parts(cell, run_dir))]


PARSER = build_parser()


@functools.cache
def _values_of(part: tuple[str, ...]) -> dict[str, Any]:
    return values_from(PARSER.parse_args(["train", *part]))


def _values(cell: Cell) -> dict[str, Any]:
    """``values_from`` of the cell's parsed command line: the union of its groups' (no option
    is in two groups; ``--model-option`` values are merged as the parser appends them)."""
    values: dict[str, Any] = {}
    for part in _parts(cell, "run"):
        for key, value in _values_of(part).items():
            if isinstance(value, dict):
                value = {**values.get(key, {}), **value}
            values[key] = value
    return values


def _valid(cell: Cell) -> bool:
    """The config's own checks of both launches (cheap: no files read), for the generator."""
    values = _values(cell)
    try:
        TrainConfig.from_flat(**values)
        if cell["continuation"] == "resume":
            TrainConfig.from_flat(**{**values, "resume": "run"})
    except ConfigError:
        return False
    return True


with toy_plugin_registered():
    CELLS = all_pairs(train_dimensions(), _valid)
    ORDER = [d.name for d in train_dimensions()]
    DIMENSIONS = train_dimensions()


@pytest.fixture(autouse=True)
def _registered_toy_plugin() -> Iterator[None]:
    with toy_plugin_registered():
        yield


def _cell_id(cell: Cell) -> str:
    return "-".join(cell[name] for name in ORDER)


def _continued_from_step_2(run: Path, to: Path) -> None:
    """``to``: ``run`` as a run killed right after its step-2 checkpoint left it."""
    shutil.copytree(run, to)
    shutil.rmtree(to / "checkpoints" / "step-00000003")
    for name in ("checkpoint.pt", "summary.json", "sample.txt", "trace.json"):
        (to / name).unlink(missing_ok=True)


def _last_loss(run: Path) -> float:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "loss" in r][-1]["loss"]


def _refusal(cell: Cell, tmp_path: Path) -> ConfigError:
    """The one refusal of a refused cell, from the validation pass of whichever launch."""
    run = tmp_path / "run"
    try:
        cfg = config_from_args(build_parser().parse_args(command(cell, run)))
        assert cell["continuation"] == "resume", "refused by the generator, accepted here"
        prepare_run_dir(cfg)  # what the first launch leaves: its config
        (run / "checkpoints" / "step-00000002").mkdir(parents=True)
        config_from_args(build_parser().parse_args(["train", "--resume", str(run)]))
    except ConfigError as exc:
        return exc
    raise AssertionError(f"cell {_cell_id(cell)} was expected to be refused, and was not")


@pytest.mark.parametrize(("cell", "valid"), CELLS, ids=[_cell_id(c) for c, _ in CELLS])
def test_cell_trains_and_resumes_bit_exact_or_is_refused_up_front(
    cell: dict[str, str], valid: bool, tmp_path: Path
) -> None:
    if not valid:
        message = str(_refusal(cell, tmp_path))
        assert "\n" not in message and len(message) < 600, message
        # it names the options in conflict: those of two dimensions of the cell at least
        named = {dim for dim, options in OPTIONS.items() if any(o in message for o in options)}
        assert len(named) >= 2, f"the refusal names no conflicting options: {message}"
        return
    run = tmp_path / "run"
    cfg = config_from_args(build_parser().parse_args(command(cell, run)))
    run_training(cfg)
    reference = load_checkpoint(run / "checkpoint.pt")
    cont = tmp_path / "cont"
    _continued_from_step_2(run, cont)
    if cell["continuation"] == "resume":
        resumed = config_from_args(build_parser().parse_args(["train", "--resume", str(cont)]))
        assert resumed.run_dir == str(cont) and resumed.checkpoint.resume == str(cont)
        run_training(resumed)
    else:  # a restarted worker: the same config, its run directory as the failure left it
        run_training(dataclasses.replace(cfg, run_dir=str(cont)), attempt=1, prepare=False)
    continued = load_checkpoint(cont / "checkpoint.pt")
    assert reference["model"].keys() == continued["model"].keys()
    for name, tensor in reference["model"].items():
        assert torch.equal(tensor, continued["model"][name]), name
    for part in ("optimizer", "compression", "sync"):
        assert_exact(reference.get(part), continued.get(part), part, key_order=False)
    assert _last_loss(cont) == _last_loss(run)


def test_the_matrix_covers_every_pair_of_registered_values() -> None:
    dims = DIMENSIONS
    covered = set()
    for cell, _ in CELLS:
        items = [(d.name, cell[d.name]) for d in dims]
        covered |= {(a, b) for i, a in enumerate(items) for b in items[i + 1 :]}
    wanted = {
        ((a.name, va), (b.name, vb))
        for i, a in enumerate(dims)
        for b in dims[i + 1 :]
        for va in a.values
        for vb in b.values
    }
    assert wanted <= covered
    assert sum(valid for _, valid in CELLS) > len(CELLS) // 2
