"""DeepSpeed's ``deepspeed.runtime.utils``: :func:`set_random_seed`."""

from __future__ import annotations

import random

import numpy as np
import torch


def set_random_seed(seed: int) -> None:
    """Seed Python's ``random``, numpy and torch with ``seed``, as DeepSpeed does (numpy takes
    it modulo 2**32, torch modulo 2**63: larger seeds are accepted).

    Unlike ``zerotron pretrain``'s Megatron seeding there is no per-stage offset and no
    tensor-parallel stream: every rank that passes the same seed draws the same numbers.
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed % 2**63)
