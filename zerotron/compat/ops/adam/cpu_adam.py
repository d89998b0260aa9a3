"""``deepspeed.ops.adam.cpu_adam.DeepSpeedCPUAdam``: DeepSpeed's signature and defaults over
:class:`zerotron.optim.adam.Adam` (torch's fused CPU Adam kernel).

Different from DeepSpeed's: parameters may live on any device (DeepSpeed's asserts CPU), and
the state's ``step`` is a tensor, as in torch's Adam (DeepSpeed's is an int).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch

from zerotron.optim.adam import Adam


class DeepSpeedCPUAdam(Adam):
    """Adam (``adamw_mode=False``) or AdamW (default), as DeepSpeed's CPU Adam.

    Args:
        model_params: tensors or param groups.
        lr, betas, eps, weight_decay: Adam's.
        bias_correction: divide the moments by ``1 - beta**t``.
        amsgrad: accepted and ignored with a warning, as DeepSpeed ignores it.
        adamw_mode: decoupled weight decay (AdamW) if True, L2 if False.
        fp32_optimizer_states: fp32 moments for 16-bit parameters.
    """

    optimizer_id = 0  # DeepSpeed numbers its instances; kept for scripts that read opt_id

    def __init__(
        self,
        model_params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
    ):
        if amsgrad:
            warnings.warn(
                "DeepSpeedCPUAdam: amsgrad=True is ignored (DeepSpeed's CPU Adam has no AMSGrad)",
                stacklevel=2,
            )
        super().__init__(
            model_params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            adam_w_mode=adamw_mode,
            bias_correction=bias_correction,
            fp32_states=fp32_optimizer_states,
        )
        self.adam_w_mode = adamw_mode
        self.fp32_optimizer_states = fp32_optimizer_states
        self.opt_id = DeepSpeedCPUAdam.optimizer_id
        DeepSpeedCPUAdam.optimizer_id += 1
