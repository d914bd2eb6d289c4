"""Time to accuracy: every engine trained to plain DDP's N-step held-out loss."""
