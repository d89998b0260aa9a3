"""``deepspeed.comm.ReduceOp``: DeepSpeed's own enum of reduction operations.

:mod:`zerotron.compat.comm` accepts it wherever ``torch.distributed.ReduceOp`` is accepted (and
torch's too); the values are DeepSpeed's.
"""

from __future__ import annotations

from enum import Enum


class ReduceOp(Enum):
    """DeepSpeed's reduction operations (``UNUSED`` is a placeholder no collective takes)."""

    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    BAND = 4
    BOR = 5
    BXOR = 6
    AVG = 7
    UNUSED = 8
