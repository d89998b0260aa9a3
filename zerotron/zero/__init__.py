"""ZeRO: optimizer states, gradients and parameters partitioned over data-parallel ranks.

- :mod:`~zerotron.zero.options`: :class:`ZeroOptions` and :class:`OffloadOptions`, typed,
  built once from the config;
- :mod:`~zerotron.zero.partition`: the chunk and bucket layout every part agrees on;
- :mod:`~zerotron.zero.masters`: this rank's fp32 partitions (sub-groups) and their layout;
- :mod:`~zerotron.zero.grads`: gradients reduce-scattered into the partitions;
- :mod:`~zerotron.zero.optimizer`: :class:`ZeroOptimizer` (stages 1, 2 and 3);
- :mod:`~zerotron.zero.state_dict`: this rank's checkpoint file;
- :mod:`~zerotron.zero.stage3`: parameters partitioned at rest (shards, with DeepSpeed's ``ds_*``
  attributes), gathered around each module (gather), by hooks that prefetch (coordinator);
- :mod:`~zerotron.zero.init`: :class:`Init`, building a model already partitioned;
- :mod:`~zerotron.zero.offload`: optimizer states and parameters on CPU or NVMe (swap files,
  pinned pool, offloaded optimizer, parameter store);
- :mod:`~zerotron.zero.memory`: bytes a rank holds, by kind.

Names are imported lazily: ``import zerotron.zero`` costs nothing until a name is used.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ZeroOptimizer": "zerotron.zero.optimizer",
    "ZeroOptions": "zerotron.zero.options",
    "OffloadOptions": "zerotron.zero.options",
    "Init": "zerotron.zero.init",
    "GatheredParameters": "zerotron.zero.stage3",
    "ZeroParamStatus": "zerotron.zero.stage3",
    "register_external_parameter": "zerotron.zero.stage3",
    "unregister_external_parameter": "zerotron.zero.stage3",
    "partition_parameters": "zerotron.zero.stage3",
    "gathered_state_dict": "zerotron.zero.stage3",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        from zerotron.config.deepspeed_refused import missing_attribute

        message = f"module 'zerotron.zero' has no attribute {name!r}"
        raise missing_attribute("deepspeed.zero", name, message)
    return getattr(importlib.import_module(module), name)
