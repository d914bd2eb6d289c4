"""The rank harness itself: what a rank sees must not depend on how it was started."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from syncline.errors import ConfigError
from syncline.launch import torchrun
from syncline.launch.torchrun import LaunchError, LaunchSpec
from syncline.testing import RankFailure, run_ranks
from syncline.testing.launcher import launch_in_process, torchrun_in_process


def _facts(rank: int, world: int) -> dict[str, object]:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return {
        "pid": os.getpid(),
        "sum": t.item(),
        "threads": torch.get_num_threads(),
        "marker": os.environ.get("SYNCLINE_HARNESS_MARKER"),
    }


def _fail_on_one(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank one broke")


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_ranks_are_fresh_processes_with_the_callers_environment_now(
    method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SYNCLINE_START_METHOD", method)
    run_ranks(_facts, 2)  # the forkserver (if any) starts here, before the marker is set
    monkeypatch.setenv("SYNCLINE_HARNESS_MARKER", "set-after-start")
    facts = run_ranks(_facts, 3, threads=2)
    pids = {f["pid"] for f in facts}
    assert len(pids) == 3 and os.getpid() not in pids
    assert [f["sum"] for f in facts] == [6.0, 6.0, 6.0]
    assert [f["threads"] for f in facts] == [2, 2, 2]
    assert [f["marker"] for f in facts] == ["set-after-start"] * 3


def test_a_failing_rank_is_named() -> None:
    with pytest.raises(RankFailure, match="(?s)rank 1 failed.*rank one broke"):
        run_ranks(_fail_on_one, 2)


def _killed_on_one(rank: int, world: int) -> None:
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))  # the peers fail here: their connection to rank 1 is gone


def test_a_killed_rank_is_named_not_the_peers_that_lost_it() -> None:
    with pytest.raises(RankFailure, match=f"rank 1 failed.*code {-signal.SIGKILL}"):
        run_ranks(_killed_on_one, 3, timeout_s=60)


def test_an_unknown_start_method_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SYNCLINE_START_METHOD", "fork")
    with pytest.raises(ConfigError, match="start method 'fork'"):
        run_ranks(_facts, 2)


# -- torchrun's part played in-process (syncline.testing.launcher) --------------------------


def _spec(out: Path, fail_rank: int, max_restarts: int) -> LaunchSpec:
    return LaunchSpec(
        module="tests.zoo.launched_job",
        args=(str(out), str(fail_rank)),
        nproc_per_node=2,
        threads_per_rank=2,
        max_restarts=max_restarts,
    )


def test_an_in_process_launch_gives_workers_torchruns_environment_and_restarts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    launch_in_process(_spec(tmp_path, fail_rank=1, max_restarts=1))
    assert not list(tmp_path.glob("attempt0.*.json"))  # rank 1 failed, rank 0 was stopped
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"attempt1.rank{rank}.json").read_text())
        assert seen["sum"] == 3.0 and seen["world"] == 2 and seen["local_world"] == 2
        assert seen["local_rank"] == rank and seen["threads"] == "2"
        assert seen["cwd"] == seen["path0"] == str(tmp_path)  # as `python -m` from there
    out, err = capsys.readouterr()
    assert "rank 1 attempt 0 starts" in out and "rank 0 attempt 1 starts" in out
    assert "rank 1 fails" in err


def test_an_in_process_launch_names_the_rank_that_failed_first(tmp_path: Path) -> None:
    with pytest.raises(LaunchError) as failed:
        launch_in_process(_spec(tmp_path, fail_rank=1, max_restarts=0))
    assert str(failed.value) == (
        "rank 1 (exit code 3) failed first; then stopped: rank 0 (killed by signal 15)"
    )
    with pytest.raises(ConfigError, match="one node"):
        launch_in_process(dataclasses.replace(_spec(tmp_path, 1, 0), nnodes=2))


def test_torchrun_in_process_stands_in_for_launch_only_while_open() -> None:
    real = torchrun.launch
    with torchrun_in_process():
        assert torchrun.launch is launch_in_process
    assert torchrun.launch is real
