"""Benchmarks of syncline against torch, one folder each: run ``python -m benchmarks.<name>``.

Scripts on the public API that write JSON to ``benchmarks/results/``; the package never
imports them.
"""
