"""Engines in process sets of their own, taking turns: fair speed comparisons on one machine.

Two engines sharing one process can move each other by 10 % (allocator state, caches,
threads), so a speed claim runs each engine in its own processes, as a user would. Run one
after the other, though, a shared machine's drift (clock frequency, neighbours) lands on
one engine or the other: on a 2-core machine, whole runs of the same engine 30 s apart
differ by +-15 %. So every engine's process set is started at once, warms up, and then
waits, asleep, while the others run: a conductor hands out turns (one timed segment each,
the order reversing every turn, :func:`~syncline.testing.bench.abba`), so the segments
compared ran seconds apart and their per-turn ratios cancel the drift.

The baton is a folder of marker files (no sockets, no shared process group): a waiting rank
looks for its turn every 50 ms, the conductor for the end of a turn every 5 ms.

Example (each engine's rank function)::

    def engine_rank(rank, world, name, baton, args):
        engine = build(name)
        ...warm up...
        seconds = []
        for turn in baton.turns(name, rank):      # blocks until it is this engine's turn
            t0 = time.perf_counter(); run_segment(engine); seconds.append(...)
        return seconds

    results = run_in_turns(engine_rank, ["a", "b"], world=2, turns=10, args=(args,))
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from syncline.testing.bench import abba
from syncline.testing.harness import run_ranks

__all__ = ["Baton", "run_in_turns"]

#: how often a waiting rank looks for its turn: rarely enough that several sleeping engines
#: take no measurable time from the one running (at 5 ms, eight sleeping ranks woke 1600
#: times a second on two cores); the wait is outside the timed segment
_RANK_POLL_S = 0.05
_CONDUCTOR_POLL_S = 0.005


def _wait_for(path: Path, timeout_s: float, what: str, *, conductor: bool = False) -> None:
    deadline = time.monotonic() + timeout_s
    poll = _CONDUCTOR_POLL_S if conductor else _RANK_POLL_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: {path.name} did not appear within {timeout_s:.0f} s")
        if conductor and any(path.parent.glob("failed-*")):
            raise TimeoutError(f"{what}: an engine failed while waiting for {path.name}")
        time.sleep(poll)


class Baton:
    """The turn-taking protocol over a folder (picklable: it is only a path and a count).

    Args:
        folder: shared by the conductor and every rank of every engine.
        turns: how many turns each engine gets.
        timeout_s: the longest any side waits for the other.
    """

    def __init__(self, folder: Path, turns: int, timeout_s: float = 1800.0) -> None:
        self.folder, self.count, self.timeout_s = Path(folder), turns, timeout_s

    def _marker(self, kind: str, name: str, turn: int, rank: int | None = None) -> Path:
        who = "" if rank is None else f"-r{rank}"
        return self.folder / f"{kind}-{name}-{turn}{who}"

    # -- a rank's side ------------------------------------------------------------------

    def turns(self, name: str, rank: int) -> Iterator[int]:
        """Yield each turn of engine ``name`` when it begins; mark it ended when the loop
        body returns. Every rank of the engine iterates (each marks its own end)."""
        (self.folder / f"ready-{name}-r{rank}").touch()
        for turn in range(self.count):
            _wait_for(self._marker("go", name, turn), self.timeout_s, f"{name} rank {rank}")
            yield turn
            self._marker("done", name, turn, rank).touch()

    # -- the conductor's side -------------------------------------------------------------

    def conduct(self, names: Sequence[str], world: int) -> None:
        """Wait until every rank of every engine is ready, then give the turns."""
        for name in names:
            for rank in range(world):
                ready = self.folder / f"ready-{name}-r{rank}"
                _wait_for(ready, self.timeout_s, "ready", conductor=True)
        for turn in range(self.count):
            for name in abba(names, turn):
                self._marker("go", name, turn).touch()
                for rank in range(world):
                    done = self._marker("done", name, turn, rank)
                    _wait_for(done, self.timeout_s, name, conductor=True)


def run_in_turns(
    fn: Callable[..., Any],
    names: Sequence[str],
    *,
    world: int,
    turns: int,
    args: tuple[Any, ...] = (),
    timeout_s: float = 3600.0,
) -> dict[str, list[Any]]:
    """Run ``fn(rank, world, name, baton, *args)`` on ``world`` fresh processes per engine
    name, all engines at once, conducting ``turns`` turns; returns each engine's per-rank
    results. ``fn`` loops over ``baton.turns(name, rank)`` around each timed segment.

    Raises:
        RankFailure: an engine's rank failed (named); TimeoutError: a turn never ended.
    """
    folder = Path(tempfile.mkdtemp(prefix="syncline-turns-"))
    baton = Baton(folder, turns, timeout_s)
    results: dict[str, list[Any]] = {}
    errors: list[BaseException] = []

    def engine(name: str) -> None:
        try:
            results[name] = run_ranks(fn, world, name, baton, *args, timeout_s=timeout_s)
        except BaseException as exc:  # reported below, after the conductor stops
            errors.append(exc)
            (folder / f"failed-{name}").touch()

    threads = [threading.Thread(target=engine, args=(n,), daemon=True) for n in names]
    for t in threads:
        t.start()
    try:
        baton.conduct(names, world)
    except TimeoutError:
        if not errors:
            raise
    finally:  # a failed engine's peers stop at their next turn's wait; end them all
        if errors:
            for name in names:
                for turn in range(turns):
                    baton._marker("go", name, turn).touch()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results
