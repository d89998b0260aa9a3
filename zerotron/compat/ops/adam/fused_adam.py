"""``deepspeed.ops.adam.fused_adam.FusedAdam``: DeepSpeed's signature and defaults over
:class:`zerotron.optim.adam.Adam` (torch's fused kernel on CUDA and CPU).

Different from DeepSpeed's: it runs on any device (DeepSpeed's needs its CUDA extension), and
the state's ``step`` is a tensor, as in torch's Adam.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from zerotron.errors import UnsupportedError
from zerotron.optim.adam import Adam


class FusedAdam(Adam):
    """Adam (``adam_w_mode=False``) or AdamW (default), as DeepSpeed's FusedAdam.

    Args:
        params: tensors or param groups.
        lr, betas, eps, weight_decay: Adam's.
        bias_correction: divide the moments by ``1 - beta**t``.
        adam_w_mode: decoupled weight decay (AdamW) if True, L2 if False.
        amsgrad: refused, as DeepSpeed refuses it.
        set_grad_none: :meth:`zero_grad` sets gradients to None.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ):
        if amsgrad:
            raise UnsupportedError(
                "FusedAdam does not support the AMSGrad variant",
                where="FusedAdam(amsgrad=True)",
                fix="use amsgrad=False, or torch.optim.AdamW(amsgrad=True)",
            )
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            adam_w_mode=adam_w_mode,
            bias_correction=bias_correction,
            fp32_states=False,  # DeepSpeed's FusedAdam keeps the moments in the param's dtype
        )
        self.adam_w_mode = 1 if adam_w_mode else 0  # DeepSpeed keeps the mode as an int
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients: to None if ``set_grad_none`` or ``set_to_none``, else zero."""
        super().zero_grad(set_to_none=self.set_grad_none or set_to_none)
