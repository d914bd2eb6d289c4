"""The lowbw benchmark: ``python -m benchmarks.lowbw --help``."""
