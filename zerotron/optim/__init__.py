"""Optimizers and learning-rate schedules.

- :mod:`~zerotron.optim.param_groups`: weight-decay groups (Megatron's rule).
- :mod:`~zerotron.optim.adamw`: :func:`build_optimizer` (AdamW / Adam / SGD, fused where torch
  has it, :class:`~zerotron.optim.lamb.Lamb`, :class:`Lion` and :class:`Adagrad`).
- :mod:`~zerotron.optim.adam`, :mod:`~zerotron.optim.lion`, :mod:`~zerotron.optim.adagrad`:
  :class:`Adam` (DeepSpeed's switches: ``adam_w_mode``, ``bias_correction``), :class:`Lion`,
  :class:`Adagrad` (DeepSpeed's math), behind ``zerotron.ops``; what the three share (state
  creation, fp32 states of 16-bit parameters) is :mod:`~zerotron.optim.elementwise`.
- :mod:`~zerotron.optim.lr_schedule`: :class:`OptimizerParamScheduler`, Megatron's warmup +
  decay schedule. Schedulers share one interface: ``step(increment)``, ``get_lr()``,
  ``state_dict()``, ``load_state_dict(state)``.
- :mod:`~zerotron.optim.ds_schedulers`: DeepSpeed's WarmupLR, WarmupDecayLR, WarmupCosineLR,
  OneCycle, LRRangeTest (:func:`build_ds_scheduler`), same interface.
"""

from zerotron.optim.adagrad import Adagrad
from zerotron.optim.adam import Adam
from zerotron.optim.adamw import build_optimizer
from zerotron.optim.ds_schedulers import (
    DS_SCHEDULERS,
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_ds_scheduler,
)
from zerotron.optim.lamb import Lamb
from zerotron.optim.lion import Lion
from zerotron.optim.lr_schedule import OptimizerParamScheduler
from zerotron.optim.param_groups import get_param_groups, is_no_decay

__all__ = [
    "DS_SCHEDULERS",
    "Adagrad",
    "Adam",
    "LRRangeTest",
    "Lamb",
    "Lion",
    "OneCycle",
    "OptimizerParamScheduler",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "build_ds_scheduler",
    "build_optimizer",
    "get_param_groups",
    "is_no_decay",
]
