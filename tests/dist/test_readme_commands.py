"""Every ``syncline ...`` command line in README.md and docs/*.md runs: a documented command
cannot crash.

The pages' fenced code blocks are parsed at import (README.md first, then docs/ in name order,
through :func:`tests.unit.test_docs.code_blocks`); every command line in them (``syncline
...``, ``sudo syncline ...``, ``bash scripts/train.sh ...``; in a block with ``$ `` prompts
only the prompted lines) is run through the real command line, block by block in one
directory so that a block's later commands see its earlier runs (``--resume runs/a``,
``syncline report runs/dp runs/pp``). Each is shrunk to a tiny model and a few steps by
:func:`shrink`; what cannot run as written on one machine is rewritten in ``ADAPTED`` (the
rewrite is the documented adaptation) or listed in ``NOT_RUN`` with the reason. A command an
earlier block already ran (as run) is not run again, unless it expects an exit code of its own
or a later command of its block reads its run (the README's overview repeats commands that
docs/ explain). A new command runs through the generic shrinking, so it fails this test until
it works or is handled here.

The commands run through ``syncline.cli.main.main`` in this process, with torchrun's part
played in-process (:func:`tests.zoo.train.launched`: the workers' own ``main`` on ranks forked
with torchrun's environment; the same exit codes and output), except the README's main
command (``REAL_LAUNCH``), as a user types it, and those on an emulated network (torchrun is
started in each network namespace): they run as ``syncline ...`` in a fresh interpreter
through the real torchrun.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
from pathlib import Path
from subprocess import CompletedProcess

import pytest

from tests.unit.test_docs import PAGES, README, REPO, code_blocks
from tests.zoo.cli import syncline
from tests.zoo.train import Cli, launched

pytestmark = pytest.mark.slow

_CRASHED_A = (
    "syncline train --steps 1000 --checkpoint-every 100 --run-dir runs/a --inject-failure 1:3"
)

# command as written in the docs -> the command(s) run instead, and why
ADAPTED: dict[str, tuple[list[str], str]] = {
    "bash scripts/train.sh": (
        ["syncline train"],
        "train.sh sets up .venv (scripts/env.sh), then execs `syncline train` with its args",
    ),
    "syncline train --nnodes 2 --node-rank $NODE --rdzv-endpoint 10.0.0.1:29500 "
    "--nproc-per-node 8": (
        ["syncline train --nnodes 1 --nproc-per-node 2"],
        "needs 2 nodes and a rendezvous host: run as the one node this machine is",
    ),
    "syncline train --compression fp16 | bf16 | topk:0.01 | powersgd:4": (
        [f"syncline train --compression {c}" for c in ("fp16", "bf16", "topk:0.01", "powersgd:4")],
        "the line lists alternatives: each is run",
    ),
    "syncline train --steps 1000 --checkpoint-every 100 --run-dir runs/a": (
        [_CRASHED_A],
        "the next line resumes 'after a crash': rank 1 dies at step 3, after the step-2 "
        "checkpoint (exit 1 expected)",
    ),
}
EXPECTED_EXIT = {_CRASHED_A: 1}

# command as written in the docs -> why it is not run (keep minimal; the reason must be real)
NOT_RUN: dict[str, str] = {
    "syncline train --model cnn": "documents the refusal without scikit-learn, which the dev "
    "environment holds; tests/dist/test_install.py runs it in an environment without it",
    "syncline train --nnodes 3": "documents the refusal inside an srun task; "
    "tests/dist/test_clusters.py runs it with the environment srun gives a task",
}

# documented commands that syncline refuses as written (exit 2 before any process starts):
# run, and the refusal pinned, so fixing the docs (or the refusal) makes this table stale
#: documented commands refused as written (each pinned to its refusal until the docs are fixed)
README_BUGS: dict[str, str] = {}

FACTORY_OPTIONS = ["--model-option", "n_layer=3", "--model-option", "n_embd=32"]

#: documented commands run through the real torchrun: what a user types first
REAL_LAUNCH = {"bash scripts/train.sh"}


def through_torchrun(command: str, run: str) -> bool:
    """Whether ``run`` (a run of the documented ``command``) goes through the real launcher:
    the README's main command, and a run on an emulated network (its launcher starts
    torchrun in each host's network namespace; it has no in-process stand-in)."""
    return command in REAL_LAUNCH or "--emulate-network" in run


#: a block of commands: where its fence is (``page:line``), and its (command, error) pairs
CommandBlock = tuple[str, list[tuple[str, str | None]]]


def commands_of(code: str) -> list[tuple[str, str | None]]:
    """A block's command lines: (command, documented error line or None).

    Backslash-continued lines are joined; a trailing ``# comment`` is dropped. In a block with
    ``$ `` prompts only prompted lines are commands, and a ``syncline ...: error:`` line right
    after one is the refusal it documents.
    """
    lines: list[str] = []
    for raw in code.splitlines():
        if lines and lines[-1].endswith("\\"):
            lines[-1] = lines[-1][:-1].rstrip() + " " + raw.strip()
        else:
            lines.append(raw)
    prompted = any(line.startswith("$ ") for line in lines)
    cmds: list[tuple[str, str | None]] = []
    for i, line in enumerate(lines):
        if prompted and not line.startswith("$ "):
            continue
        cmd = re.sub(r"\s+#.*$", "", line.removeprefix("$ ")).strip()
        if not cmd.startswith(("syncline ", "sudo syncline ", "bash scripts/train.sh")):
            continue
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        error = nxt if prompted and re.match(r"syncline \w+: error:", nxt) else None
        cmds.append((cmd, error))
    return cmds


def runs_of(command: str) -> list[str]:
    """The command lines run for a documented one (its adaptation, or itself)."""
    return ADAPTED[command][0] if command in ADAPTED else [command]


def is_repeat(command: str, error: str | None, later: list[str], ran: set[str]) -> bool:
    """Whether ``command`` need not run again: every run of it was made by an earlier block,
    it expects exit 0, and nothing later in its block reads what it writes."""
    args = shlex.split(command.removeprefix("sudo "))
    run_dir = _value(args, "--run-dir")
    return (
        error is None
        and all(r in ran and r not in EXPECTED_EXIT for r in runs_of(command))
        and "--resume" not in args
        and not (run_dir and any(run_dir in c for c in later))
    )


def doc_blocks() -> tuple[list[CommandBlock], list[str]]:
    """The command blocks of README.md and docs/*.md to run, and every command documented.

    A repeat (:func:`is_repeat`) is left out of its block, though listed as documented; a block
    left with no command is dropped.
    """
    blocks: list[CommandBlock] = []
    found: list[str] = []
    ran: set[str] = set()
    for page in PAGES:
        for block in code_blocks(page):
            if block.lang not in ("", "bash", "console", "sh"):
                continue
            cmds = commands_of(block.code)
            found += [c for c, _ in cmds]
            kept = []
            for i, (cmd, error) in enumerate(cmds):
                if is_repeat(cmd, error, [c for c, _ in cmds[i + 1 :]], ran):
                    continue
                ran.update(runs_of(cmd))
                kept.append((cmd, error))
            if kept:
                blocks.append((block.where, kept))
    return blocks, found


def _set(args: list[str], flag: str, value: str, *, only_if_absent: bool = False) -> None:
    if flag in args:
        if not only_if_absent:
            args[args.index(flag) + 1] = value
    else:
        args += [flag, value]


def _value(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def shrink(command: str) -> list[str]:
    """The arguments that run ``command`` with a tiny model and a few steps.

    ``--steps N`` becomes 2 + 2 x (N // 1000) (so 1000 -> 4, 2000 -> 6: an extended run stays
    longer than the one it extends), ``--checkpoint-every`` 2, a batch at most 16, a GPT of one
    layer (kept when given, or when ``--balance`` fixes the layer count), width 32, 16 tokens;
    no sample, no evaluation. A ``--resume`` run keeps its run's config (only steps change).
    ``plan --cluster`` keeps its model (no allocation) on at most 8 ranks and 4 layers.
    ``--emulate-network`` links run at 1gbit: ``plan --profile`` sends up to 16 MiB a probe
    (~40 s at 100 Mbit/s), the same namespaces and code at any rate.
    """
    args = shlex.split(command.removeprefix("sudo "))[1:]
    sub, resume = args[0], "--resume" in args
    steps = _value(args, "--steps")
    if "--emulate-network" in args:
        _set(args, "--emulate-network", "1gbit")
    if sub == "report":
        return args
    if sub == "train":
        if steps or not resume:  # a resume without --steps keeps its run's
            _set(args, "--steps", str(2 + 2 * (int(steps) // 1000)) if steps else "2")
        _set(args, "--sample-tokens", "0")
        _set(args, "--eval-every", "0")
        _set(args, "--log-every", "1")
        if "--checkpoint-every" in args:
            _set(args, "--checkpoint-every", "2")
        if resume:
            return args
    if sub == "plan" and "--cluster" in args:
        _set(args, "--ranks", str(min(int(_value(args, "--ranks") or 8), 8)))
        _set(args, "--n-layer", str(min(int(_value(args, "--n-layer") or 4), 4)))
        return args
    batch = _value(args, "--batch-size")
    _set(args, "--batch-size", str(min(int(batch), 16)) if batch else "16")
    model = _value(args, "--model") or "gpt"
    if model == "gpt":
        if "--balance" not in args:
            _set(args, "--n-layer", "1", only_if_absent=True)
        _set(args, "--n-embd", "32")
        _set(args, "--seq-len", "16", only_if_absent=True)
    elif ":" in model:  # the README's GPT-2 factory: 3 blocks (its split point is block 2)
        args += FACTORY_OPTIONS
        _set(args, "--seq-len", "16", only_if_absent=True)
    return args


BLOCKS, FOUND = doc_blocks()


def _can_emulate() -> bool:
    return os.geteuid() == 0 and bool(shutil.which("ip")) and bool(shutil.which("tc"))


def _prepare(cwd: Path) -> None:
    """What the documented commands expect in the current directory: ``gpt2_factory.py`` (the
    python block of the docs that builds it), a ``my_texts/`` folder, and ``examples/``."""
    factories = [
        b.code
        for page in PAGES
        for b in code_blocks(page)
        if b.lang == "python" and b.code.startswith("from transformers import GPT2Config")
    ]
    assert len(factories) == 1, f"expected one gpt2_factory.py block, found {len(factories)}"
    (cwd / "gpt2_factory.py").write_text(factories[0])
    (cwd / "my_texts").mkdir()
    (cwd / "my_texts" / "readme.md").write_text(README.read_text())
    (cwd / "examples").symlink_to(REPO / "examples")


def test_every_documented_command_is_handled() -> None:
    """Found = run (as written, shrunk, or adapted) + NOT_RUN; no stale adaptation."""
    assert len(FOUND) >= 30, f"parsed only {len(FOUND)} documented commands: {FOUND}"
    assert set(ADAPTED) <= set(FOUND), set(ADAPTED) - set(FOUND)
    assert set(NOT_RUN) <= set(FOUND), set(NOT_RUN) - set(FOUND)
    assert set(README_BUGS) <= set(FOUND), set(README_BUGS) - set(FOUND)
    assert set(REAL_LAUNCH) <= set(FOUND), set(REAL_LAUNCH) - set(FOUND)
    assert "syncline report runs/dp runs/pp --out compare.png" in FOUND
    assert any(c.startswith("syncline plan --profile") for c in FOUND)
    ran = {r for _, block in BLOCKS for c, _ in block for r in runs_of(c)}
    never = [c for c in FOUND if c not in NOT_RUN and not set(runs_of(c)) <= ran]
    assert not never, f"documented commands that no block runs: {never}"


def test_parsing_and_repeats() -> None:
    """Prompts, refusals, continuation lines; a repeat runs once unless its block needs it."""
    code = "$ syncline train --batch-size 33\nsyncline train: error: bad\n$ ls\n"
    assert commands_of(code) == [("syncline train --batch-size 33", "syncline train: error: bad")]
    code = "syncline train --steps 5 \\\n    --n-layer 2  # a note\npython x.py\nsyncline train\n"
    assert commands_of(code) == [
        ("syncline train --steps 5 --n-layer 2", None),
        ("syncline train", None),
    ]
    ran = {"syncline train", "syncline train --run-dir runs/x", "syncline train --resume runs/a"}
    assert is_repeat("syncline train", None, [], ran)
    assert is_repeat("bash scripts/train.sh", None, [], ran)  # runs as `syncline train`
    assert not is_repeat("syncline train --steps 3", None, [], ran)
    assert not is_repeat("syncline train", "syncline train: error: x", [], ran)
    assert not is_repeat("syncline train --run-dir runs/x", None, ["syncline report runs/x"], ran)
    assert not is_repeat("syncline train --resume runs/a", None, [], ran)
    emulated = shrink("sudo syncline plan --profile --emulate-network 100mbit")
    assert emulated[:4] == ["plan", "--profile", "--emulate-network", "1gbit"], emulated
    assert through_torchrun("bash scripts/train.sh", "syncline train")
    emulated_run = "sudo syncline train --emulate-network 100mbit"
    assert through_torchrun(emulated_run, emulated_run)
    assert not through_torchrun("syncline train", "syncline train")


def _syncline(command: str, run: str, args: list[str], cwd: Path) -> Cli | CompletedProcess[str]:
    """``syncline ARGS`` for a run of ``command``: through the real torchrun in a fresh
    interpreter, or in this process (:func:`through_torchrun`)."""
    if through_torchrun(command, run):
        return syncline(*args)
    return launched(*args, cwd=cwd)


@pytest.mark.parametrize(
    "block", [b for _, b in BLOCKS], ids=[f"{where}:{b[0][0][:40]}" for where, b in BLOCKS]
)
def test_documented_block_runs(block: list[tuple[str, str | None]], tmp_path, monkeypatch) -> None:
    _prepare(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), str(REPO)]))
    skipped = []
    for command, error in block:
        if command in NOT_RUN:
            continue
        for run in runs_of(command):
            if run in README_BUGS:  # refused as written: pin the refusal
                res = _syncline(command, run, shrink(run), tmp_path)
                assert res.returncode == 2, (run, res.stdout[-1500:], res.stderr[-2500:])
                assert README_BUGS[run].removesuffix(", see issue 39") in res.stderr, res.stderr
                continue
            if "--emulate-network" in run and not _can_emulate():
                skipped.append(run)
                continue
            args = shlex.split(run)[1:] if error else shrink(run)
            res = _syncline(command, run, args, tmp_path)
            detail = f"{run!r} ran as {args}:\n{res.stdout[-1500:]}\n{res.stderr[-2500:]}"
            if error:  # a documented refusal: exit 2 and its line
                assert res.returncode == 2, detail
                assert error in res.stderr, detail
                continue
            assert res.returncode == EXPECTED_EXIT.get(run, 0), detail
            if "--json" in args:
                assert json.loads(res.stdout)["candidates"], detail
    assert (tmp_path / "compare.png").exists() or not any(
        c.startswith("syncline report") for c, _ in block
    )
    if skipped:
        pytest.skip(f"needs root and iproute2 (ip, tc): {skipped}")
