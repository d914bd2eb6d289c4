"""Waits and barriers by backend: gloo's named host timeouts; elsewhere (NCCL) stream waits and
a barrier that is not ``monitored_barrier`` (which raises ``ValueError`` off gloo).

The NCCL branches run here with torch's ``fake`` backend (every collective accepted, nothing
delivered) or with the backend name forced, as no GPU is needed to take them.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from syncline.comm import groups
from syncline.comm.collectives import Pending, host_list
from syncline.errors import CommError, CommTimeout


class _Work:
    """A stand-in ``dist.Work`` that records how it was waited on."""

    def __init__(self, *, result: bool = True, error: str | None = None) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self._result, self._error = result, error

    def wait(self, *args: Any) -> bool:
        self.calls.append(args)
        if self._error is not None:
            raise RuntimeError(self._error)
        return self._result

    def is_completed(self) -> bool:
        return True


def _force(monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    monkeypatch.setattr(groups, "backend_name", lambda group=None: backend)


def test_gloo_waits_on_the_host_with_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    _force(monkeypatch, "gloo")
    work = _Work()
    Pending([work], "allreduce of bucket 0", 7.0, 3).wait()  # type: ignore[list-item]
    assert work.calls == [(datetime.timedelta(seconds=7),)]


def test_nccl_waits_are_stream_waits_without_a_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    _force(monkeypatch, "nccl")
    works = [_Work(), _Work()]
    done: list[str] = []
    Pending(works, "x", 7.0, 3, then=lambda: done.append("then")).wait()  # type: ignore[arg-type]
    assert [w.calls for w in works] == [[()], [()]]
    assert done == ["then"]


def test_gloo_timeout_text_names_rank_and_what(monkeypatch: pytest.MonkeyPatch) -> None:
    _force(monkeypatch, "gloo")
    late = _Work(error="[../gloo/transport] Timed out waiting 7000ms for recv operation")
    with pytest.raises(CommTimeout, match=r"^rank 3: allreduce of bucket 2 did not complete "):
        Pending([late], "allreduce of bucket 2", 7.0, 3).wait()  # type: ignore[list-item]
    with pytest.raises(CommTimeout, match=r"^rank 3: y did not complete within 7s$"):
        Pending([_Work(result=False)], "y", 7.0, 3).wait()  # type: ignore[list-item]
    broken = _Work(error="Connection closed by peer")
    with pytest.raises(CommError, match=r"^rank 3: z failed: Connection closed by peer$"):
        Pending([broken], "z", 7.0, 3).wait()  # type: ignore[list-item]


@pytest.fixture
def fake_group() -> Iterator[None]:
    """A 2-rank ``fake`` default group (this process is rank 0), on CPU, CUDA and meta."""
    dist.init_process_group("cpu:fake,cuda:fake,meta:fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_barrier_off_gloo_is_an_allreduce_on_the_comm_device(
    fake_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[torch.device] = []
    all_reduce = dist.all_reduce

    def spy(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append(tensor.device)
        return all_reduce(tensor, *args, **kwargs)

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("monitored_barrier called off gloo")

    monkeypatch.setattr(dist, "all_reduce", spy)
    monkeypatch.setattr(dist, "monitored_barrier", refuse)
    groups.barrier(timeout_s=5.0, what="checkpoint 3: published")
    groups.barrier(what="end of run", device=torch.device("meta"))
    assert calls == [torch.device("cpu"), torch.device("meta")]


def test_barrier_failure_names_rank_and_purpose(
    fake_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any, **kwargs: Any) -> None:
        raise ValueError("no such device")

    monkeypatch.setattr(dist, "all_reduce", broken)
    with pytest.raises(CommError, match=r"^rank 0: checkpoint 3: published failed: no such"):
        groups.barrier(timeout_s=5.0, what="checkpoint 3: published")


def test_host_list_reads_values_and_stands_in_on_meta() -> None:
    assert host_list(torch.tensor([3, 1]), meta=[0]) == [3, 1]
    assert host_list(torch.empty(2, device="meta"), meta=[5, 6]) == [5, 6]
