"""``deepspeed.ops.lion.fused_lion.FusedLion``: DeepSpeed's signature and defaults over
:class:`zerotron.optim.lion.Lion` (torch foreach ops, any device).

Different from DeepSpeed's: it runs on any device (DeepSpeed's needs its CUDA extension); an
element whose momentum interpolation is exactly 0 does not move (DeepSpeed's kernel steps it by
``+lr``; see :mod:`zerotron.optim.lion`); the state's ``step`` is a tensor.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from zerotron.optim.lion import Lion


class FusedLion(Lion):
    """Lion as DeepSpeed's FusedLion.

    Args:
        params: tensors or param groups.
        lr, betas, weight_decay: Lion's (decoupled weight decay).
        set_grad_none: :meth:`zero_grad` sets gradients to None.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        set_grad_none: bool = True,
    ):
        # DeepSpeed's FusedLion keeps the momentum in the parameter's dtype
        super().__init__(params, lr=lr, betas=betas, weight_decay=weight_decay, fp32_states=False)
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients: to None if ``set_grad_none`` or ``set_to_none``, else zero."""
        super().zero_grad(set_to_none=self.set_grad_none or set_to_none)
