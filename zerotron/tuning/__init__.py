"""Tuning: how much memory a run needs, and which layout to run.

- :mod:`~zerotron.tuning.estimate`: per-rank memory of a model and a layout (the interface the
  planner and the tuner use): :class:`ModelShape`, :class:`Layout`, :func:`estimate`;
- :mod:`~zerotron.tuning.model_states`: parameters, gradients, masters, optimizer states and
  buffers as zerotron's ZeRO stages keep them;
- :mod:`~zerotron.tuning.activations`: activations as zerotron's GPT keeps them, and
  Korthikanti et al. 2022's formulas;
- :mod:`~zerotron.tuning.zero_memory`: DeepSpeed's model-states memory estimates for ZeRO-2 and
  ZeRO-3 (bytes per CPU and per GPU for each offload option), as pure functions, and the
  per-element byte counts everything above shares;
- :mod:`~zerotron.tuning.measure`: builds a run and measures what it holds, per term (with
  :mod:`zerotron.engine.memory_breakdown`), to check the estimator;
- :mod:`~zerotron.tuning.estimate_cli`: ``zerotron estimate``;
- :mod:`~zerotron.tuning.volume`: the bytes each rank communicates in a step, per group and op
  (the closed form the comm ledger is checked against);
- :mod:`~zerotron.tuning.cost`: the predicted time of a step (compute, communication, the
  simulated pipeline bubble) on a described cluster;
- :mod:`~zerotron.tuning.plan` and :mod:`~zerotron.tuning.plan_cli`: every valid layout, what
  fits, ranked by predicted step time (``zerotron plan``).
"""
