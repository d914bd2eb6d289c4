"""Shared test setup: the models, pipeline cases and runners of the command line (in a
subprocess, or in-process without its launcher: ``tests.zoo.train``) that tests build on.

Tests import these modules, never private helpers of other test files. Everything here lives
at module level in an importable module, so ``syncline.testing.run_ranks`` can pickle rank
functions that use it.
"""
