"""The dp_vs_ddp benchmark: ``python -m benchmarks.dp_vs_ddp --help``."""
