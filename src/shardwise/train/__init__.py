"""The training engine: per-rank setup, the loop, metrics and checkpoints."""
