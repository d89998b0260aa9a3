"""Gradient checks that span process groups: global norm, clipping, overflow, zero count.

Every function takes "params or grads": an ``nn.Parameter`` stands for its gradient (its fp32
``main_grad`` when it has one, else ``.grad``; parameters without a gradient are skipped), any
other tensor is taken as a gradient itself.

Two hooks let the parallel layers plug in without this module knowing about process groups:

- ``reduce_fn(tensor, op)`` combines a 1-element tensor (fp32; int64 for counts) across every
  rank that holds a part of the model (tensor-, pipeline- and, for ZeRO partitions,
  data-parallel groups); ``op`` is ``"sum"`` or ``"max"``. It may reduce in place and must
  return the result. None means one process.
- ``is_counted(param)`` says whether this rank counts a parameter in the norm, so a parameter
  replicated across tensor-parallel ranks (a LayerNorm weight) or shared between pipeline stages
  (tied embeddings) is counted once. The default counts all.

Norms are computed in fp32 with ``torch._foreach_norm`` (one fused kernel per dtype and device);
the single-process 2-norm equals ``torch.nn.utils.clip_grad_norm_``'s bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Literal

import torch
from torch import Tensor

ReduceFn = Callable[[Tensor, Literal["sum", "max"]], Tensor]
"""Combine a 1-element tensor across ranks: ``reduce_fn(tensor, "sum" | "max") -> tensor``."""

IsCounted = Callable[[Tensor], bool]
"""``is_counted(param) -> bool``: whether this rank counts ``param`` in the gradient norm."""


def grad_of(item: Tensor) -> Tensor | None:
    """The gradient an item stands for: a parameter's ``main_grad`` or ``.grad``, or the tensor."""
    if isinstance(item, torch.nn.Parameter):
        main_grad = getattr(item, "main_grad", None)
        return main_grad if main_grad is not None else item.grad
    return item


def _grads(items: Iterable[Tensor], is_counted: IsCounted | None = None) -> list[Tensor]:
    if is_counted is not None:
        items = (t for t in items if is_counted(t))
    return [g for g in map(grad_of, items) if g is not None]


def _by_device_dtype(tensors: list[Tensor]) -> dict[tuple[torch.device, torch.dtype], list[Tensor]]:
    # foreach kernels fuse only over tensors of one device and dtype.
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return groups


def _fp32_norms(grads: list[Tensor], norm_type: float) -> Tensor:
    """Per-tensor norms in fp32, stacked on the first gradient's device."""
    first = grads[0].device
    norms: list[Tensor] = []
    for group in _by_device_dtype(grads).values():
        norms.extend(torch._foreach_norm(group, norm_type, dtype=torch.float32))
    return torch.stack([n.to(first) for n in norms])


@torch.no_grad()
def get_grad_norm(
    params_or_grads: Iterable[Tensor],
    norm_type: float = 2.0,
    *,
    reduce_fn: ReduceFn | None = None,
    is_counted: IsCounted | None = None,
) -> Tensor:
    """The norm of all gradients taken as one vector, as a 0-dim fp32 tensor.

    ``norm_type`` is any p >= 1 or ``inf``. Across ranks, the p-th powers of the local norms are
    summed (the maximum for ``inf``), so the result is the norm of the whole model's gradient.
    """
    norm_type = float(norm_type)
    grads = _grads(params_or_grads, is_counted)
    if grads:
        stacked = _fp32_norms(grads, norm_type)
        if norm_type == float("inf"):
            local = stacked.amax()
        else:
            local = torch.linalg.vector_norm(stacked, norm_type)
    else:
        local = torch.zeros((), dtype=torch.float32)
    if reduce_fn is None:
        return local
    if norm_type == float("inf"):
        return reduce_fn(local.reshape(1), "max").reshape(())
    total = reduce_fn((local**norm_type).reshape(1), "sum").reshape(())
    return total ** (1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm_(
    params_or_grads: Iterable[Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    total_norm: Tensor | float | None = None,
    reduce_fn: ReduceFn | None = None,
    is_counted: IsCounted | None = None,
) -> Tensor:
    """Scale all gradients in place so their global norm is at most ``max_norm``.

    The norm counts only ``is_counted`` parameters (pass ``total_norm`` if it is already known);
    all gradients are scaled. The coefficient is ``max_norm / (norm + 1e-6)``, computed in fp32
    as ``torch.nn.utils.clip_grad_norm_`` does, and nothing is touched when it is >= 1.
    Returns the total norm before clipping.
    """
    items = list(params_or_grads)
    if total_norm is None:
        total_norm = get_grad_norm(items, norm_type, reduce_fn=reduce_fn, is_counted=is_counted)
    total_norm = torch.as_tensor(total_norm, dtype=torch.float32)
    clip_coef = max_norm / (total_norm + 1e-6)
    if clip_coef < 1.0:
        for (device, _), group in _by_device_dtype(_grads(items)).items():
            torch._foreach_mul_(group, clip_coef.to(device))
    return total_norm


def _any_nonfinite_local(grads: list[Tensor]) -> Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    # The inf-norm reads each element once, propagates nan, and cannot overflow the way a sum
    # of squares of large finite values can.
    amax = _fp32_norms(grads, float("inf"))
    return (~torch.isfinite(amax)).any().float().cpu()


@torch.no_grad()
def has_overflow(params_or_grads: Iterable[Tensor], *, reduce_fn: ReduceFn | None = None) -> bool:
    """True if any gradient on any rank holds an inf or nan."""
    flag = _any_nonfinite_local(_grads(params_or_grads))
    if reduce_fn is not None:
        flag = reduce_fn(flag.reshape(1), "max")
    return bool(flag.item() > 0)


@torch.no_grad()
def unscale_and_check_overflow_(
    grads: list[Tensor], inv_scale: float, *, reduce_fn: ReduceFn | None = None
) -> bool:
    """Multiply fp32 gradients by ``inv_scale`` in place and report inf/nan on any rank.

    One fused pass (``torch._amp_foreach_non_finite_check_and_unscale_``) per device instead of
    a multiply followed by a check.
    """
    found_inf = torch.zeros(1, dtype=torch.float32)
    for (device, _), group in _by_device_dtype(grads).items():
        found = torch.zeros(1, dtype=torch.float32, device=device)
        inv = torch.full((1,), inv_scale, dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(group, found, inv)
        found_inf = torch.maximum(found_inf, found.cpu())
    if reduce_fn is not None:
        found_inf = reduce_fn(found_inf, "max")
    return bool(found_inf.item() > 0)


@torch.no_grad()
def count_zeros(
    params_or_grads: Iterable[Tensor],
    *,
    reduce_fn: ReduceFn | None = None,
    is_counted: IsCounted | None = None,
) -> int:
    """Number of gradient elements that are exactly zero (Megatron's ``num zeros``)."""
    grads = _grads(params_or_grads, is_counted)
    numel = sum(g.numel() for g in grads)
    if grads:
        first = grads[0].device
        nonzero = torch.stack([torch.count_nonzero(g).to(first) for g in grads]).sum()
        local = (numel - nonzero).reshape(1).cpu()
    else:
        local = torch.zeros(1, dtype=torch.int64)
    if reduce_fn is not None:
        local = reduce_fn(local, "sum")
    return int(local.item())
