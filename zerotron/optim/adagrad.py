"""Adagrad as DeepSpeed's CPU Adagrad computes it, foreach.

Per element (``lr``, ``wd``, ``eps`` the group's; ``v`` starts at 0)::

    d = g + wd * p
    v = v + d * d
    p = p - lr * g / (sqrt(v) + eps)

The numerator is the raw gradient ``g``, the accumulator takes the L2-decayed one: that is
DeepSpeed's kernel (AVX and scalar alike), and differs from ``torch.optim.Adagrad`` (decayed
gradient in both places, plus ``lr_decay`` and ``initial_accumulator_value``), which is why this
is written here with torch's foreach ops rather than taken from torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from zerotron.optim.adam import HALF_DTYPES, check_hyper, dense_grad


class Adagrad(torch.optim.Optimizer):
    """DeepSpeed's Adagrad (see the module docstring), a drop-in torch optimizer.

    Args:
        params: tensors or param groups; a group may set ``lr``, ``eps``, ``weight_decay``.
        lr, eps, weight_decay: Adagrad's (L2 weight decay).
        fp32_states: keep ``exp_avg_sq`` in fp32 for 16-bit parameters (the step is computed
            in fp32 and rounded into the parameter); False keeps it in the parameter's dtype.
    """

    zero_elementwise = True  # each element's update reads only that element: ZeRO may shard it

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-2,
        eps: float = 1e-10,
        weight_decay: float = 0.0,
        *,
        fp32_states: bool = True,
    ):
        check_hyper(lr=lr, eps=eps, weight_decay=weight_decay)
        super().__init__(params, dict(lr=lr, eps=eps, weight_decay=weight_decay))
        self.fp32_states = fp32_states

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One Adagrad step over every parameter that has a gradient; returns ``closure()``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            ps, gs, vs, steps, back = [], [], [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = dense_grad(p, self)
                state = self.state[p]
                if not state:
                    dtype = (
                        torch.float32 if self.fp32_states and p.dtype in HALF_DTYPES else p.dtype
                    )
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype)
                v = state["exp_avg_sq"]
                if v.dtype != p.dtype:  # fp32 state of a 16-bit parameter: step an fp32 copy
                    back.append((p, p.float()))
                    ps.append(back[-1][1])
                    gs.append(g.float())
                else:
                    ps.append(p)
                    gs.append(g.to(p.dtype))
                vs.append(v)
                steps.append(state["step"])
            if not ps:
                continue
            adagrad_step(ps, gs, vs, group["lr"], group["eps"], group["weight_decay"])
            torch._foreach_add_(steps, 1)
            for p, p32 in back:
                p.copy_(p32)
        return loss


def adagrad_step(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    lr: float,
    eps: float,
    weight_decay: float,
) -> None:
    """DeepSpeed's Adagrad update of ``params`` and ``exp_avg_sqs`` in place."""
    decayed = torch._foreach_add(grads, params, alpha=weight_decay) if weight_decay else grads
    torch._foreach_addcmul_(exp_avg_sqs, decayed, decayed)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, grads, denom, value=-lr)
