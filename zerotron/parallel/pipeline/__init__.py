"""Holds :mod:`~zerotron.parallel.pipeline.gpt_stage` (a GPT cut into pipeline stages) until it
moves to ``zerotron/models/``; the pipeline itself is :mod:`zerotron.pipeline`."""
