"""The rank harness itself: what a rank sees must not depend on how it was started."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from syncline.errors import ConfigError
from syncline.testing import RankFailure, run_ranks


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


def test_an_unknown_start_method_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SYNCLINE_START_METHOD", "fork")
    with pytest.raises(ConfigError, match="start method 'fork'"):
        run_ranks(_facts, 2)
