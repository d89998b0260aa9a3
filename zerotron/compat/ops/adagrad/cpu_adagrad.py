"""``deepspeed.ops.adagrad.cpu_adagrad.DeepSpeedCPUAdagrad``: DeepSpeed's signature and defaults
over :class:`zerotron.optim.adagrad.Adagrad` (DeepSpeed's Adagrad math on torch's kernel).

Different from DeepSpeed's: parameters may live on any device; sparse gradients are refused
(DeepSpeed's steps only the rows a sparse gradient touches); the state's ``step`` is a tensor.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from zerotron.optim.adagrad import Adagrad


class DeepSpeedCPUAdagrad(Adagrad):
    """Adagrad as DeepSpeed's CPU Adagrad computes it.

    Args:
        model_params: tensors or param groups.
        lr, eps, weight_decay: Adagrad's (L2 weight decay into the accumulator).
        amsgrad: kept in the param groups and ignored, as DeepSpeed does.
        fp32_optimizer_states: fp32 accumulator for 16-bit parameters.
    """

    optimizer_id = 0  # DeepSpeed numbers its instances; kept for scripts that read opt_id

    def __init__(
        self,
        model_params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-2,
        eps: float = 1e-10,
        weight_decay: float = 0,
        amsgrad: bool = False,
        fp32_optimizer_states: bool = True,
    ):
        super().__init__(
            model_params,
            lr=lr,
            eps=eps,
            weight_decay=weight_decay,
            fp32_states=fp32_optimizer_states,
        )
        for group in self.param_groups:
            group.setdefault("amsgrad", amsgrad)
        self.fp32_optimizer_states = fp32_optimizer_states
        self.opt_id = DeepSpeedCPUAdagrad.optimizer_id
        DeepSpeedCPUAdagrad.optimizer_id += 1
