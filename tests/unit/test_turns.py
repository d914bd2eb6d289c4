"""Engines in process sets of their own take turns (the benchmarks' fairness device)."""

from __future__ import annotations

import itertools
import time

from syncline.testing.turns import Baton, run_in_turns


def _engine(rank: int, world: int, name: str, baton: Baton) -> list[tuple[float, float]]:
    spans = []
    for _ in baton.turns(name, rank):
        t0 = time.monotonic()
        time.sleep(0.05)
        spans.append((t0, time.monotonic()))
    return spans


def test_turns_alternate_in_abba_order_and_never_overlap() -> None:
    results = run_in_turns(_engine, ["a", "b"], world=1, turns=4, timeout_s=120)
    spans = sorted((s, e, name) for name in results for s, e in results[name][0])
    assert [name for _, _, name in spans] == ["a", "b", "b", "a", "a", "b", "b", "a"]
    for (_, end, _), (start, _, _) in itertools.pairwise(spans):
        assert end <= start  # one engine at a time
