"""DeepSpeed's ``deepspeed.runtime`` (importable as ``zerotron.runtime``), the names scripts use:

- :mod:`~zerotron.compat.runtime.utils`: ``set_random_seed``;
- :mod:`~zerotron.compat.runtime.engine`: ``DeepSpeedEngine`` (the Engine ``initialize`` returns);
- :mod:`~zerotron.compat.runtime.dataloader`: ``RepeatingLoader``;
- :mod:`~zerotron.compat.runtime.lr_schedules`: ``VALID_LR_SCHEDULES`` and the schedules;
- :mod:`~zerotron.compat.runtime.zero`: ``partition_parameters`` (``ZeroParamStatus``,
  ``GatheredParameters``, ``Init``) and the memory estimators of ``stage_1_and_2`` and
  ``stage3``;
- :mod:`~zerotron.compat.runtime.pipe`: ``deepspeed.runtime.pipe`` (``PipelineModule``...).

Submodules are imported when named, as in DeepSpeed.
"""

from zerotron.compat.submodules import submodule_getattr

__getattr__ = submodule_getattr(__name__)
