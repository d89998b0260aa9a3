"""LAMB (You et al., 2019, "Large Batch Optimization for Deep Learning"), DeepSpeed's variant.

Per tensor, an Adam direction (with bias correction) plus decoupled weight decay, scaled by a
trust ratio ``||w|| / ||update||`` clamped to ``[min_coeff, max_coeff]`` (1 when either norm is
0), as DeepSpeed's ``FusedLamb`` computes it::

    m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g²
    u = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + weight_decay · w
    w -= lr · clamp(||w|| / ||u||, min_coeff, max_coeff) · u

The trust ratio needs each whole tensor, so LAMB does not run under ZeRO (which steps flat
partitions); the config refuses that combination.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor


class Lamb(torch.optim.Optimizer):
    """LAMB over ``params`` (tensors or param groups).

    Args:
        lr: learning rate.
        betas: Adam's (beta1, beta2).
        eps: added to the denominator.
        weight_decay: decoupled weight decay, inside the trust-ratio-scaled update.
        max_coeff, min_coeff: bounds of the trust ratio (DeepSpeed's defaults 10 and 0.01).
        bias_correction: divide the moments by ``1 - beta^t``.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        bias_correction: bool = True,
    ):
        if lr < 0 or eps <= 0 or weight_decay < 0 or not 0 <= min_coeff <= max_coeff:
            raise ValueError(
                f"invalid Lamb settings: lr={lr}, eps={eps}, weight_decay={weight_decay}, "
                f"min_coeff={min_coeff}, max_coeff={max_coeff}"
            )
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
            bias_correction=bias_correction,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad.float()
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] += 1
                t = int(state["step"].item())
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                if group["bias_correction"]:
                    m_hat, v_hat = m / (1 - beta1**t), v / (1 - beta2**t)
                else:
                    m_hat, v_hat = m, v
                weight = p.float()
                update = m_hat / (v_hat.sqrt() + group["eps"])
                if group["weight_decay"]:
                    update.add_(weight, alpha=group["weight_decay"])
                w_norm, u_norm = weight.norm().item(), update.norm().item()
                trust = 1.0
                if w_norm > 0 and u_norm > 0:
                    trust = min(max(w_norm / u_norm, group["min_coeff"]), group["max_coeff"])
                p.add_((update * (-group["lr"] * trust)).to(p.dtype))
        return loss
