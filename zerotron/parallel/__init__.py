"""Parallelism: tensor (and later sequence, data and pipeline) parallel building blocks."""
