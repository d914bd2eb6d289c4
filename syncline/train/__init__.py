"""Training loop, checkpoints, metrics and progress for ``syncline train``."""
