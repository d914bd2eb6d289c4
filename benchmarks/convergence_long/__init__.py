"""Long-run convergence of the compressors against DDP and its PowerSGD hook."""
