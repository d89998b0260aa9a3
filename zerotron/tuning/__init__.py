"""Tuning: how much memory a run needs, and (later) which layout to run.

- :mod:`~zerotron.tuning.zero_memory`: DeepSpeed's model-states memory estimates for ZeRO-2 and
  ZeRO-3 (bytes per CPU and per GPU for each offload option), as pure functions.
"""
