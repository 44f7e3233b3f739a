"""Fusion passes, the kernel IR and lowering from kernel graphs to plans."""
