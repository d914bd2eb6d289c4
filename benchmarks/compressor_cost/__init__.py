"""The compressor_cost benchmark: ``python -m benchmarks.compressor_cost --help``."""
