"""Every ``python`` block of README.md and docs/*.md runs as written: the docs cannot rot.

A block whose first line is ``# torchrun --nproc-per-node N ...`` is a script for torchrun: it
runs as N processes with the environment torchrun gives its workers (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, one
thread each), so its ``dist.init_process_group("gloo")`` starts a real group. The processes
are forked from the ``forkserver`` of :func:`syncline.testing.run_ranks`, which imported
torch once (the harness's reason: seconds per process), and run the script as
``__main__``. A block with an ``if __name__ == "__main__":`` guard runs as ``python
block.py`` in a fresh interpreter and directory (one that starts ranks of its own with
``run_ranks`` needs a real ``__main__`` file, which its ranks' own server imports); any
other block is a script run as ``__main__`` in one process forked the same way, from its
own directory (a block that only defines a factory is thereby executed, its imports
checked). A block preceded by ``<!-- not run: reason -->`` is skipped with that reason.
Every process must exit 0; on failure the test shows each one's output.
"""

from __future__ import annotations

import os
import re
import runpy
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from syncline.testing.harness import _context
from tests.unit.test_docs import REPO, Block, python_blocks

pytestmark = pytest.mark.slow

BLOCKS = python_blocks()
_TORCHRUN = re.compile(r"#\s*torchrun\s+--nproc[-_]per[-_]node[ =](\d+)\b")


def ranks_of(block: Block) -> int | None:
    """N for a block written for ``torchrun --nproc-per-node N``, else None (a script)."""
    first = block.code.lstrip().splitlines()[0]
    found = _TORCHRUN.match(first)
    return int(found.group(1)) if found else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_script(script: Path, timeout: float = 300) -> list[tuple[int, str]]:
    """``python block.py`` in the block's directory: [(exit code, output)]."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(script.parent), str(REPO)])}
    res = subprocess.run(
        [sys.executable, script.name],
        cwd=script.parent,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    return [(res.returncode, res.stdout)]


def has_main_guard(block: Block) -> bool:
    """Whether the block runs code under ``if __name__ == "__main__":`` (as a file of its own)."""
    return re.search(r"""^if __name__ == ["']__main__["']:""", block.code, re.M) is not None


def _rank_main(script: str, environ: dict[str, str], log: str, threads: int | None) -> None:
    """One process: its environment, output to ``log``, the script as main from its folder;
    ``threads``: torchrun's ``OMP_NUM_THREADS`` for a worker (torch is imported already)."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.clear()
    os.environ.update(environ)
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    folder = os.path.dirname(script)
    os.chdir(folder)
    sys.path.insert(0, folder)
    sys.argv = [script]
    runpy.run_path(script, run_name="__main__")


def _run_forked(script: Path, timeout: float = 300) -> list[tuple[int, str]]:
    """``python block.py`` in the block's directory, forked with torch imported:
    [(exit code, output)]."""
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(script.parent), str(REPO)])}
    return _run_processes(script, [environ], None, timeout)


def _run_ranks(script: Path, ranks: int, timeout: float = 300) -> list[tuple[int, str]]:
    """The script as ``torchrun --nproc-per-node ranks`` runs it: [(exit code, output)]."""
    port = str(_free_port())
    environs = [
        {
            **os.environ,
            "RANK": str(r),
            "LOCAL_RANK": str(r),
            "WORLD_SIZE": str(ranks),
            "LOCAL_WORLD_SIZE": str(ranks),
            "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
        }
        for r in range(ranks)
    ]
    return _run_processes(script, environs, 1, timeout)


def _run_processes(
    script: Path, environs: list[dict[str, str]], threads: int | None, timeout: float
) -> list[tuple[int, str]]:
    """The script as main in one forked process per environment: [(exit code, output)]."""
    ctx = _context(None)
    procs, logs = [], []
    for r, environ in enumerate(environs):
        logs.append(script.parent / f"rank{r}.log")
        args = (str(script), environ, str(logs[-1]), threads)
        procs.append(ctx.Process(target=_rank_main, args=args))
        procs[-1].start()
    deadline = time.monotonic() + timeout
    try:  # a rank that fails leaves its peers waiting on it: they get 10 s, then are stopped
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            if any(p.exitcode not in (None, 0) for p in procs):
                deadline = min(deadline, time.monotonic() + 10)
            time.sleep(0.1)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [
        (p.exitcode if p.exitcode is not None else -9, log.read_text())
        for p, log in zip(procs, logs, strict=True)
    ]


def test_blocks_found() -> None:
    """The parser sees the README's two examples and the docs' scripts for several ranks."""
    readme = [b for b in BLOCKS if b.page.name == "README.md"]
    assert [ranks_of(b) for b in readme] == [2, 2], [b.where for b in readme]
    assert sum(ranks_of(b) is not None for b in BLOCKS) >= 8, [b.where for b in BLOCKS]
    assert ranks_of(Block(REPO, 1, "python", "# torchrun --nproc-per-node 4 x.py\n", None)) == 4
    assert ranks_of(Block(REPO, 1, "python", "import torch\n", None)) is None
    guarded = [b.where for b in BLOCKS if ranks_of(b) is None and has_main_guard(b)]
    # the run_ranks example starts ranks: a real __main__ file
    run_ranks_example = next(
        b.where for b in BLOCKS if b.page.name == "testing.md" and "run_ranks(" in b.code
    )
    assert run_ranks_example in guarded, (run_ranks_example, guarded)
    assert not has_main_guard(Block(REPO, 1, "python", "x = '__main__'\n", None))


@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_python_block_runs(block: Block, tmp_path: Path) -> None:
    if block.not_run is not None:
        pytest.skip(f"marked not run: {block.not_run}")
    script = tmp_path / "block.py"
    script.write_text(block.code)
    ranks = ranks_of(block)
    if ranks is None:
        results = _run_script(script) if has_main_guard(block) else _run_forked(script)
    else:
        results = _run_ranks(script, ranks)
        if any("already in use" in out for _, out in results):
            results = _run_ranks(script, ranks)  # the free port was taken meanwhile: again
    report = "\n".join(
        f"--- process {i}: exit {rc}\n{out[-3000:]}" for i, (rc, out) in enumerate(results)
    )
    assert all(rc == 0 for rc, _ in results), f"{block.where} failed:\n{report}"
