"""``deepspeed.comm.torch``: :class:`TorchBackend`, whose class methods scripts use to pick the
fused all-gather and reduce-scatter (DeepSpeed's communication benchmark does).

Here they return ``deepspeed.comm``'s own functions (same signatures as torch's), so the
transfers still go through :mod:`zerotron.distributed.comm` and its ledger. The backend object
itself is zerotron's comm layer: there is nothing to construct.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from zerotron.compat.comm.comm import all_gather_into_tensor, reduce_scatter_tensor
from zerotron.errors import UnsupportedError


class TorchBackend:
    """DeepSpeed's torch.distributed backend class, for its class methods."""

    def __init__(self, *args: Any, **kwargs: Any):
        raise UnsupportedError(
            "TorchBackend objects are DeepSpeed's internal backend; zerotron's comm layer "
            "takes their place",
            where="deepspeed.comm.TorchBackend",
            fix="call deepspeed.init_distributed() and the deepspeed.comm functions",
        )

    @classmethod
    def get_all_gather_function(cls) -> Callable[..., Any]:
        """``all_gather_into_tensor(output, input, group=None, async_op=False)``."""
        return all_gather_into_tensor

    @classmethod
    def get_reduce_scatter_function(cls) -> Callable[..., Any]:
        """``reduce_scatter_tensor(output, input, op=SUM, group=None, async_op=False)``."""
        return reduce_scatter_tensor

    @classmethod
    def has_all_gather_into_tensor(cls) -> bool:
        """True, on every backend."""
        return True

    @classmethod
    def has_reduce_scatter_tensor(cls) -> bool:
        """True, on every backend."""
        return True
