"""Adagrad as DeepSpeed's CPU Adagrad computes it, on torch's Adagrad kernel.

Per element (``lr``, ``wd``, ``eps`` the group's; ``v`` starts at 0)::

    g = g + wd * p                  (L2 weight decay)
    v = v + g * g
    p = p - lr * g / (sqrt(v) + eps)

That is ``torch.optim.Adagrad`` with ``lr_decay=0`` and ``initial_accumulator_value=0``, so the
step is torch's kernel (fused on the CPU, where torch has one, else foreach). This class exists
beside torch's because torch's creates its state for every parameter when it is built, and
ZeRO must be handed an optimizer that has none yet (it re-points the groups at its flat
partitions first). DeepSpeed 0.19.8's op computes the above; the source at v0.19.5-27 divided the
raw gradient (not the decayed one) by the root, which differs only with weight decay.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.adagrad import adagrad as _adagrad_kernel

from zerotron.optim.elementwise import ElementwiseOptimizer, GroupTensors, check_hyper


class Adagrad(ElementwiseOptimizer):
    """DeepSpeed's Adagrad (see the module docstring), a drop-in torch optimizer.

    Args:
        params: tensors or param groups; a group may set ``lr``, ``eps``, ``weight_decay``.
        lr, eps, weight_decay: Adagrad's (L2 weight decay).
        fp32_states: keep ``exp_avg_sq`` (the sum of squares) in fp32 for 16-bit parameters
            (the step is computed in fp32 and rounded into the parameter); False keeps it in
            the parameter's dtype.
        fused: None picks torch's fused kernel when every parameter is on the CPU (the one
            device torch has it for), else the foreach kernel; True/False force it.
    """

    STATE_NAMES = ("exp_avg_sq",)

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-2,
        eps: float = 1e-10,
        weight_decay: float = 0.0,
        *,
        fp32_states: bool = True,
        fused: bool | None = None,
    ):
        check_hyper(lr=lr, eps=eps, weight_decay=weight_decay)
        super().__init__(params, dict(lr=lr, eps=eps, weight_decay=weight_decay))
        self.fp32_states = fp32_states
        self.fused = fused

    def _step_group(self, group: dict[str, Any], t: GroupTensors) -> None:
        ps = t.params
        fused = self.fused if self.fused is not None else all(p.is_cpu for p in ps)
        _adagrad_kernel(
            ps,
            t.grads,
            t.states["exp_avg_sq"],
            t.steps,
            fused=fused or None,
            foreach=None if fused else True,
            grad_scale=None,
            found_inf=None,
            has_sparse_grad=False,
            differentiable=False,
            has_complex=False,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            lr_decay=0.0,
            eps=group["eps"],
            maximize=False,
        )
