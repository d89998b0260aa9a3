"""Adam with DeepSpeed's switches: decoupled (AdamW) or L2 weight decay, bias correction on/off.

One Adam for every name DeepSpeed gives it (``DeepSpeedCPUAdam``, ``FusedAdam``): the step is
torch's own Adam/AdamW kernel (fused on the devices torch has one for, CPU included; foreach
elsewhere), the same kernel :func:`~zerotron.optim.adamw.build_optimizer` uses. Per element,
with ``g`` the gradient, ``t`` the step, ``lr``, ``wd``, ``b1``, ``b2``, ``eps`` the group's::

    g = g + wd * p                  (adam_w_mode=False: L2, coupled)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    c1, c2 = 1 - b1**t, 1 - b2**t   (bias_correction=False: c1 = c2 = 1)
    p = p * (1 - lr * wd)           (adam_w_mode=True: decoupled)
    p = p - lr / c1 * m / (sqrt(v) / sqrt(c2) + eps)

That is DeepSpeed's CPU and CUDA Adam. The kernels differ in rounding, and one way more:
DeepSpeed's CPU op takes the betas as fp32 and forms ``1 - b`` in fp32 (``1 - 0.999f`` is
0.00099998713), so its updates drift from the formula by up to ~1e-5 relative; torch's kernel,
hence this one, keeps those scalars in double and stays within a few fp32 ulps of the formula
(with betas exact in fp32, both are as close). Torch's kernel has no bias-correction switch, so
without bias correction it is given an infinite step count (``b**inf == 0``: both corrections
are exactly 1) while the real count is kept in the state. The state is torch's Adam state
(``step``, ``exp_avg``, ``exp_avg_sq``), so ZeRO's sub-group stepping, offload and checkpoints
treat it as they treat torch's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.adam import adam as _adam_kernel
from torch.optim.adamw import adamw as _adamw_kernel
from torch.optim.optimizer import _get_fused_kernels_supported_devices

from zerotron.optim.elementwise import ElementwiseOptimizer, GroupTensors, check_hyper


class Adam(ElementwiseOptimizer):
    """Adam/AdamW (see the module docstring), a drop-in torch optimizer.

    Args:
        params: tensors or param groups; a group may set any of the keyword defaults below.
        lr, betas, eps, weight_decay: Adam's.
        adam_w_mode: decoupled weight decay (AdamW) if True, L2 added to the gradient if False.
        bias_correction: divide by ``1 - beta**t`` as in the paper, or not.
        fp32_states: keep ``exp_avg``/``exp_avg_sq`` in fp32 for 16-bit parameters (the step
            is then computed in fp32 and rounded into the parameter); False keeps them in the
            parameter's dtype.
        fused: None picks torch's fused kernel where the parameters' device has one, else the
            foreach kernel; True/False force it.
    """

    STATE_NAMES = ("exp_avg", "exp_avg_sq")
    STEPS_ON_PARAM_DEVICE = True

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        adam_w_mode: bool = True,
        bias_correction: bool = True,
        fp32_states: bool = True,
        fused: bool | None = None,
    ):
        check_hyper(lr=lr, eps=eps, weight_decay=weight_decay, betas=betas)
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            adam_w_mode=adam_w_mode,
            bias_correction=bias_correction,
        )
        super().__init__(params, defaults)
        self.fp32_states = fp32_states
        self.fused = fused

    def _step_group(self, group: dict[str, Any], t: GroupTensors) -> None:
        ps, steps = t.params, t.steps
        b1, b2 = group["betas"]
        kernel = _adamw_kernel if group["adam_w_mode"] else _adam_kernel
        fused = self._use_fused(ps)
        if group["bias_correction"]:
            kernel_steps = steps  # the kernel advances them
        else:
            torch._foreach_add_(steps, 1)
            inf = {p.device: torch.tensor(float("inf"), device=p.device) for p in ps}
            kernel_steps = [inf[p.device] for p in ps]
        kernel(
            ps,
            t.grads,
            t.states["exp_avg"],
            t.states["exp_avg_sq"],
            [],
            kernel_steps,
            foreach=None if fused else True,
            fused=fused or None,
            capturable=False,
            differentiable=False,
            grad_scale=None,
            found_inf=None,
            has_complex=False,
            amsgrad=False,
            beta1=b1,
            beta2=b2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )

    def _use_fused(self, params: list[torch.Tensor]) -> bool:
        if self.fused is not None:
            return self.fused
        devices = set(_get_fused_kernels_supported_devices())
        return all(p.device.type in devices for p in params)
