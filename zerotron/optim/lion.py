"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), foreach.

DeepSpeed's CPU and CUDA Lion, per element (``lr``, ``wd``, ``b1``, ``b2`` the group's)::

    c = b1 * m + (1 - b1) * g
    p = p * (1 - lr * wd) - lr * sign(c)
    m = b2 * m + (1 - b2) * g

torch has no Lion, so this is written with torch's foreach ops (one kernel per operation over
a list of tensors), run over batches of about :data:`BLOCK` elements so that the five passes
find their operands in cache. One difference from DeepSpeed's kernels, where ``c`` is exactly 0:
``sign(0) = 0`` here (the paper's ``sign``), so an element with zero gradient and zero momentum
does not move; DeepSpeed's kernels step it by ``lr`` (CPU: ``-copysign(lr, c)``; CUDA: ``+lr``).
ZeRO's zero padding relies on such elements staying zero.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from zerotron.optim.elementwise import ElementwiseOptimizer, GroupTensors, check_hyper


class Lion(ElementwiseOptimizer):
    """Lion (see the module docstring), a drop-in torch optimizer.

    Args:
        params: tensors or param groups; a group may set ``lr``, ``betas``, ``weight_decay``.
        lr, betas, weight_decay: Lion's (decoupled weight decay).
        fp32_states: keep ``exp_avg`` in fp32 for 16-bit parameters (the step is computed in
            fp32 and rounded into the parameter); False keeps it in the parameter's dtype.
    """

    STATE_NAMES = ("exp_avg",)

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        fp32_states: bool = True,
    ):
        check_hyper(lr=lr, weight_decay=weight_decay, betas=betas)
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))
        self.fp32_states = fp32_states

    def _step_group(self, group: dict[str, Any], t: GroupTensors) -> None:
        lion_step(
            t.params, t.grads, t.states["exp_avg"], group["lr"], *group["betas"],
            group["weight_decay"],
        )  # fmt: skip
        torch._foreach_add_(t.steps, 1)


BLOCK = 1 << 17
"""Elements per batch of :func:`lion_step`: its five passes run over one batch while it is in
cache, then the next (measurements: bench/README.md, ``optimizers.py``)."""


def lion_step(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
) -> None:
    """Lion's update of ``params`` and ``exp_avgs`` in place (the module docstring's math)."""
    for ps, gs, ms in _batches((params, grads, exp_avgs), BLOCK):
        c = torch._foreach_lerp(ms, gs, 1 - beta1)  # b1 * m + (1 - b1) * g
        torch._foreach_sign_(c)
        if weight_decay != 0:
            torch._foreach_mul_(ps, 1 - lr * weight_decay)
        torch._foreach_add_(ps, c, alpha=-lr)
        torch._foreach_lerp_(ms, gs, 1 - beta2)


def _batches(
    lists: tuple[list[torch.Tensor], ...], block: int
) -> Iterator[tuple[list[torch.Tensor], ...]]:
    """The tensors of ``lists`` (same shapes position by position) as batches of about
    ``block`` elements: small tensors together, large ones cut into flat slices (views)."""
    batch: list[tuple[torch.Tensor, ...]] = []
    size = 0
    for ts in zip(*lists):
        n = ts[0].numel()
        if all(t.is_contiguous() for t in ts):
            flat = [t.view(-1) for t in ts]
            pieces = [tuple(f[a : a + block] for f in flat) for a in range(0, n, block)]
        else:  # rare (a strided view): the whole tensor as one piece
            pieces = [ts]
        for piece in pieces:
            batch.append(piece)
            size += piece[0].numel()
            if size >= block:
                yield tuple(list(x) for x in zip(*batch))
                batch, size = [], 0
    if batch:
        yield tuple(list(x) for x in zip(*batch))
