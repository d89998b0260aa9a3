"""zerotron: train GPT-style language models from one CPU process to thousands of GPUs."""

__version__ = "0.1.0"
