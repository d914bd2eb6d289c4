"""Shared test setup: the models, pipeline cases and subprocess runners that tests build on.

Tests import these modules, never private helpers of other test files. Everything here lives
at module level in an importable module, so ``syncline.testing.run_ranks`` can pickle rank
functions that use it.
"""
