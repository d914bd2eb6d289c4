"""The gpu_check benchmark: ``scripts/gpu_check.sh`` (``python -m benchmarks.gpu_check --help``)."""
