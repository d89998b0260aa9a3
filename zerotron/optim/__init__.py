"""Optimizers and learning-rate schedules.

- :mod:`~zerotron.optim.param_groups`: weight-decay groups (Megatron's rule).
- :mod:`~zerotron.optim.adamw`: :func:`build_optimizer` (AdamW / Adam / SGD, fused where torch
  has it).
- :mod:`~zerotron.optim.lr_schedule`: :class:`OptimizerParamScheduler`, Megatron's warmup +
  decay schedule. Schedulers share one interface: ``step(increment)``, ``get_lr()``,
  ``state_dict()``, ``load_state_dict(state)``.
"""

from zerotron.optim.adamw import build_optimizer
from zerotron.optim.lr_schedule import OptimizerParamScheduler
from zerotron.optim.param_groups import get_param_groups, is_no_decay

__all__ = ["OptimizerParamScheduler", "build_optimizer", "get_param_groups", "is_no_decay"]
