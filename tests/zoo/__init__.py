"""Shared test setup: the models, pipeline cases and runners of the command line (in a
subprocess through the real torchrun, or in-process: ``tests.zoo.train``, without the
launcher or with torchrun's part played in-process) that tests build on.

Tests import these modules, never private helpers of other test files. Everything here lives
at module level in an importable module, so ``syncline.testing.run_ranks`` can pickle rank
functions that use it.
"""
