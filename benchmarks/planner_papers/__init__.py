"""The planner beside two papers' published figures (PipeDream-2BW, GradientFlow)."""
