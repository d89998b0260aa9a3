"""ZeRO: optimizer states, gradients and parameters partitioned over data-parallel ranks.

- :mod:`~zerotron.zero.partition`: the chunk and bucket layout every part agrees on;
- :mod:`~zerotron.zero.optimizer`: :class:`ZeroOptimizer` (stages 1, 2 and 3);
- :mod:`~zerotron.zero.stage3`: parameters partitioned at rest, gathered around each module;
- :mod:`~zerotron.zero.init`: :class:`Init`, building a model already partitioned;
- :mod:`~zerotron.zero.offload`: optimizer states and parameters on CPU or NVMe.

Names are imported lazily: ``import zerotron.zero`` costs nothing until a name is used.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ZeroOptimizer": "zerotron.zero.optimizer",
    "OffloadOptions": "zerotron.zero.offload",
    "Init": "zerotron.zero.init",
    "GatheredParameters": "zerotron.zero.stage3",
    "register_external_parameter": "zerotron.zero.stage3",
    "unregister_external_parameter": "zerotron.zero.stage3",
    "partition_parameters": "zerotron.zero.stage3",
    "gathered_state_dict": "zerotron.zero.stage3",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'zerotron.zero' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
