"""DeepSpeed's ``deepspeed.runtime.zero.partition_parameters``: the ZeRO-3 names client code
imports from there (:mod:`zerotron.zero.stage3` and :mod:`zerotron.zero.init` hold them).

``zero_wrapper_for_fp_tensor_constructor`` and ``_orig_torch_arange`` are here because
transformers swaps the wrapper around ``zero.Init`` (``prevent_arange_dtype_change``). DeepSpeed's
Init routes torch's tensor constructors through that wrapper; zerotron's Init partitions each
module's parameters after its ``__init__`` and wraps no constructor, so the wrapper is never
called by zerotron: it returns the constructor unchanged for whoever calls it.
"""

from collections.abc import Callable
from typing import Any

import torch

from zerotron.zero.init import Init
from zerotron.zero.stage3 import GatheredParameters
from zerotron.zero.stage3.shards import ZeroParamStatus

_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(fn: Callable, *args: Any, **kwargs: Any) -> Callable:
    """DeepSpeed's tensor-constructor wrapper; zerotron's Init needs none: ``fn`` itself."""
    return fn


__all__ = [
    "GatheredParameters",
    "Init",
    "ZeroParamStatus",
    "zero_wrapper_for_fp_tensor_constructor",
]
