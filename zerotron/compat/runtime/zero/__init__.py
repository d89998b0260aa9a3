"""DeepSpeed's ``deepspeed.runtime.zero``: ``partition_parameters`` (``ZeroParamStatus``,
``GatheredParameters``, ``Init``) and the memory estimators in ``stage_1_and_2`` and
``stage3``. The ZeRO machinery itself is :mod:`zerotron.zero` (also ``deepspeed.zero``)."""

from zerotron.compat.submodules import submodule_getattr

__getattr__ = submodule_getattr(__name__)
