"""Helpers for tests and benchmarks: run a function on N real local ranks."""

from syncline.testing.harness import RankFailure, run_ranks

__all__ = ["RankFailure", "run_ranks"]
