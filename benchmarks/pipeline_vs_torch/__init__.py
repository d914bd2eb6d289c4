"""The pipeline_vs_torch benchmark: ``python -m benchmarks.pipeline_vs_torch --help``."""
