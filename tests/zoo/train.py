"""``syncline train`` without its launcher: the command's own parsing and validation in this
process, then the workers' own code (:func:`syncline.train.worker.run_rank`) on ranks forked by
:func:`syncline.testing.run_ranks`, each with a real gloo group (~1-3 s a tiny run, where a
torchrun launch costs ~7 s before the first step).

What torchrun would give a worker comes in as arguments: ``attempt`` is its restart count
(``--max-restarts``), ``cwd`` the folder it was started from (a user's factory module is found
there, and relative data paths read from there). What the ranks print is captured per rank in
files and handed back (a forked rank writes to the descriptors of the server it was forked
from, which pytest's ``capfd`` does not see after the first test that started it).

Bad input and ``--help`` go through :func:`cli` (``syncline.cli.main.main`` itself); a whole
command that launches workers (``train``, ``plan --profile``, ``train --plan auto``) through
:func:`launched`: ``main`` itself, with torchrun played in-process.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from syncline.cli.main import build_parser, config_from_args, main
from syncline.registry import import_plugins
from syncline.testing import RankFailure, run_ranks
from syncline.testing.launcher import torchrun_in_process
from syncline.testing.training import _training_rank
from syncline.train.config import TrainConfig
from syncline.train.preflight import prepare_run_dir

__all__ = [
    "Cli",
    "Trained",
    "cli",
    "config",
    "launched",
    "train",
    "train_failing",
    "train_restarted",
]


def _with_defaults(args: tuple[str, ...]) -> list[str]:
    """``args`` with the generated sample off unless asked for (``--sample-tokens``), as
    :func:`tests.zoo.cli.syncline` does: 200 tokens cost a pipeline 200 forward passes."""
    return [*args] if "--sample-tokens" in args else [*args, "--sample-tokens", "0"]


@contextlib.contextmanager
def _in(cwd: Path | None) -> Iterator[None]:
    """Run the command's checks from ``cwd``, whose modules import (as ``main`` arranges);
    after, the modules imported from there are forgotten (the next test writes its own)."""
    if cwd is None:
        yield
        return
    before, path, modules = os.getcwd(), list(sys.path), set(sys.modules)
    os.chdir(cwd)
    sys.path.insert(0, str(cwd))
    try:
        yield
    finally:
        os.chdir(before)
        sys.path[:] = path
        for name in set(sys.modules) - modules:
            if str(getattr(sys.modules[name], "__file__", "") or "").startswith(str(cwd)):
                del sys.modules[name]


def config(*args: str, cwd: Path | None = None) -> TrainConfig:
    """The validated config of ``syncline train ARGS`` (the command's one validation pass).

    Raises:
        ConfigError: as the command would refuse it (exit code 2).
    """
    plugins = [value for flag, value in itertools.pairwise(args) if flag == "--plugin"]
    with _in(cwd):
        import_plugins(plugins)  # before the parser is built: their entries become options
        return config_from_args(build_parser().parse_args(["train", *_with_defaults(args)]))


@dataclass
class Trained:
    """A finished (or failed) in-process run: its config, directory and printed output."""

    cfg: TrainConfig
    summaries: list[dict[str, Any]] = field(default_factory=list)
    stdout: str = ""  # every rank's, rank 0 first
    stderr: str = ""
    failure: RankFailure | None = None

    @property
    def text(self) -> str:
        return self.stdout + self.stderr


def _rank(
    rank: int, world: int, values: dict[str, Any], attempt: int, out: str, cwd: str | None
) -> Any:
    """One worker: its output into ``out/rank{rank}.{stdout,stderr}``, started from ``cwd``."""
    for fd, name in ((1, "stdout"), (2, "stderr")):
        (sys.stdout if fd == 1 else sys.stderr).flush()
        target = os.open(f"{out}/rank{rank}.{name}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    if cwd is not None:  # torchrun starts each worker with `python -m` from the command's cwd
        os.chdir(cwd)
        sys.path.insert(0, cwd)
    try:
        return _training_rank(rank, world, values, attempt)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def _run(cfg: TrainConfig, attempt: int, prepare: bool, cwd: Path | None) -> Trained:
    if prepare:
        with _in(cwd):
            prepare_run_dir(cfg)
    done = Trained(cfg)
    with tempfile.TemporaryDirectory(prefix="syncline-train-out-") as out:
        try:
            done.summaries = run_ranks(
                _rank,
                cfg.world_size,
                cfg.to_dict(),
                attempt,
                out,
                None if cwd is None else str(cwd),
                timeout_s=240.0,
                threads=cfg.threads,
                comm_timeout_s=cfg.timeout_s,
            )
        except RankFailure as exc:
            done.failure = exc
        for name in ("stdout", "stderr"):
            text = ""
            for rank in range(cfg.world_size):
                path = Path(out) / f"rank{rank}.{name}"
                text += path.read_text(errors="replace") if path.exists() else ""
            setattr(done, name, text)
    return done


def train(*args: str, cwd: Path | None = None) -> Trained:
    """``syncline train ARGS``, validated by the command's code and trained by the workers'
    own; fails (showing the ranks' output) if any rank fails."""
    done = _run(config(*args, cwd=cwd), 0, True, cwd)
    assert done.failure is None, f"{done.failure}\n{done.text[-3000:]}"
    return done


def train_failing(*args: str, cwd: Path | None = None) -> Trained:
    """As :func:`train`, for a run that must fail (``--inject-failure``): its
    :class:`RankFailure` is in ``failure``."""
    done = _run(config(*args, cwd=cwd), 0, True, cwd)
    assert done.failure is not None, done.text[-3000:]
    return done


def train_restarted(*args: str, cwd: Path | None = None) -> Trained:
    """``syncline train ARGS`` (with ``--inject-failure`` and ``--max-restarts 1``) as torchrun
    runs it: the first attempt fails, the workers start again as attempt 1 (what torchrun's
    restart count tells them) on the same run directory, not prepared again, and must
    finish. The output of both attempts, as the command prints it."""
    first = train_failing(*args, cwd=cwd)
    again = _run(first.cfg, 1, False, cwd)
    assert again.failure is None, f"{again.failure}\n{again.text[-3000:]}"
    again.stdout, again.stderr = first.stdout + again.stdout, first.stderr + again.stderr
    return again


@dataclass(frozen=True)
class Cli:
    """What ``syncline ARGS`` returned and printed."""

    returncode: int
    stdout: str
    stderr: str


def cli(*args: str, cwd: Path | None = None) -> Cli:
    """``syncline ARGS`` through :func:`syncline.cli.main.main` in this process: its exit code
    (argparse's ``SystemExit`` included, as for ``--help`` or a value of the wrong type) and
    what it printed. For commands that launch nothing: bad input, ``--help``, planning from a
    saved cluster."""
    out, err = io.StringIO(), io.StringIO()
    with _in(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    return Cli(code, out.getvalue(), err.getvalue())


def launched(*args: str, cwd: Path | None = None) -> Cli:
    """``syncline ARGS`` as :func:`cli` runs it, with torchrun's part played in-process
    (:func:`syncline.testing.launcher.torchrun_in_process`): the whole command, its output
    and exit code (1 for a failed job), and the workers' own ``main`` on ranks forked with
    torchrun's environment. A ``train`` run skips the generated sample unless asked for, as
    :func:`tests.zoo.cli.syncline` does."""
    if args[:1] == ("train",):
        args = tuple(_with_defaults(args))
    with torchrun_in_process():
        return cli(*args, cwd=cwd)
