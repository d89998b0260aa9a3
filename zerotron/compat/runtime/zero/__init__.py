"""DeepSpeed's ``deepspeed.runtime.zero``: ``partition_parameters`` (``ZeroParamStatus``,
``GatheredParameters``, ``Init``), which this package also names directly as DeepSpeed's does
(``deepspeed.runtime.zero.GatheredParameters``), and the memory estimators in
``stage_1_and_2`` and ``stage3``. The ZeRO machinery itself is :mod:`zerotron.zero` (also
``deepspeed.zero``)."""

from typing import Any

from zerotron.compat.submodules import submodule_getattr

_NAMES = ("Init", "GatheredParameters", "ZeroParamStatus", "register_external_parameter")
_submodule = submodule_getattr(__name__)


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        import zerotron.zero

        return getattr(zerotron.zero, name)
    return _submodule(name)
