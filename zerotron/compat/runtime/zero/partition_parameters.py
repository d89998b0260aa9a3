"""DeepSpeed's ``deepspeed.runtime.zero.partition_parameters``: the ZeRO-3 names client code
imports from there (:mod:`zerotron.zero.stage3` and :mod:`zerotron.zero.init` hold them)."""

from zerotron.zero.init import Init
from zerotron.zero.stage3 import GatheredParameters
from zerotron.zero.stage3.shards import ZeroParamStatus

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus"]
