"""``deepspeed.ops.lion.cpu_lion.DeepSpeedCPULion``: DeepSpeed's signature and defaults over
:class:`zerotron.optim.lion.Lion` (torch foreach ops).

Different from DeepSpeed's: parameters may live on any device; an element whose momentum
interpolation is exactly 0 does not move (see :mod:`zerotron.optim.lion`); no unused
``exp_avg_sq`` state is allocated; the state's ``step`` is a tensor.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from zerotron.optim.lion import Lion


class DeepSpeedCPULion(Lion):
    """Lion as DeepSpeed's CPU Lion.

    Args:
        model_params: tensors or param groups.
        lr, betas, weight_decay: Lion's (decoupled weight decay).
        fp32_optimizer_states: fp32 momentum for 16-bit parameters.
    """

    optimizer_id = 0  # DeepSpeed numbers its instances; kept for scripts that read opt_id

    def __init__(
        self,
        model_params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0,
        fp32_optimizer_states: bool = True,
    ):
        super().__init__(
            model_params,
            lr=lr,
            betas=betas,
            weight_decay=weight_decay,
            fp32_states=fp32_optimizer_states,
        )
        self.fp32_optimizer_states = fp32_optimizer_states
        self.opt_id = DeepSpeedCPULion.optimizer_id
        DeepSpeedCPULion.optimizer_id += 1
