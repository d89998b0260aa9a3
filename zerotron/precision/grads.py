"""Gradient checks that span process groups: global norm, clipping, overflow, zero count; and
:func:`accumulate_grad_`, a 16-bit gradient added into an fp32 accumulation buffer.

Every function takes "params or grads": an ``nn.Parameter`` stands for its gradient (its fp32
``main_grad`` when it has one, else ``.grad``; parameters without a gradient are skipped), any
other tensor is taken as a gradient itself.

Two hooks let the parallel layers plug in without this module knowing about process groups:

- ``reduce_fn(tensor, op)`` combines a 1-element tensor (fp64 for norms, fp32 for overflow
  flags, int64 for counts) across every rank that holds a part of the model (tensor-,
  pipeline- and, for ZeRO partitions, data-parallel groups); ``op`` is ``"sum"`` or ``"max"``.
  It may reduce in place and must return the result. None means one process.
- ``is_counted(param)`` says whether this rank counts a parameter in the norm, so a parameter
  replicated across tensor-parallel ranks (a LayerNorm weight) or shared between pipeline stages
  (tied embeddings) is counted once. The default counts all.

Accuracy of the norm. One fp32 reduction over millions of elements (``torch._foreach_norm`` on
CPU, as ``torch.nn.utils.clip_grad_norm_`` does) is only good to ~1e-4 relative on a GPT-2
embedding gradient, and differently so on each tensor-parallel shard: layouts that clip would
drift apart. Here each gradient is cut into rows of :data:`ROW` elements; a row's p-norm is taken
in fp32 (short, so accurate to a few ulps), and the rows' p-th powers are summed in fp64, as is a
gradient shorter than a row (or the tail of a long one) directly. The result is good to ~1e-9
relative, costs no more than the fused fp32 kernel (bench/grad_norm.py), and is reduced across
ranks in fp64. The inf-norm is a maximum and exact in any precision.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any, Literal

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


# Elements per piece when a 16-bit gradient is added into an fp32 buffer on CPU (4 MB of fp32).
ACCUMULATE_PIECE = 1 << 20


def accumulate_grad_(main_grad: Tensor, grad: Tensor) -> None:
    """``main_grad += grad``: a gradient of any float dtype into an fp32 accumulation buffer.

    On CPU torch's mixed-dtype ``add_`` first converts the whole gradient into a fresh fp32
    tensor (for GPT-2's ``[50304, 384]`` embedding: 77 MB, which the allocator maps afresh and
    each page of which faults on first touch); here each piece of ``ACCUMULATE_PIECE`` elements
    is converted into one small reused buffer and added from there (bench/README.md has the
    measurement). The same fp32 sum, element for element.
    """
    n = grad.numel()
    if (
        grad.dtype == main_grad.dtype
        or main_grad.device.type != "cpu"
        or n <= ACCUMULATE_PIECE
        or not (main_grad.is_contiguous() and grad.is_contiguous())
    ):
        main_grad.add_(grad)
        return
    flat_main, flat_grad = main_grad.view(-1), grad.view(-1)
    buf = torch.empty(ACCUMULATE_PIECE, dtype=main_grad.dtype)
    for start in range(0, n, ACCUMULATE_PIECE):
        piece = flat_grad[start : start + ACCUMULATE_PIECE]
        converted = buf[: piece.numel()].copy_(piece)
        flat_main[start : start + ACCUMULATE_PIECE].add_(converted)


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


ROW = 1024
"""Elements per fp32 partial norm: short enough to be accurate, long enough to be fast."""


def _power_sum(grads: list[Tensor], p: float) -> Tensor:
    """``sum(|g| ** p)`` over all gradients, a 0-dim fp64 tensor (see the module docstring).

    One reduction kernel per long gradient; the rest (row results, short gradients and tails)
    is gathered into two vectors, so the op count stays low for models with many small tensors.
    """
    first = grads[0].device
    rows: list[Tensor] = []  # fp32 per-row results
    rest: list[Tensor] = []  # short gradients and tails, summed in fp64 outright
    for grad in grads:
        flat = grad.reshape(-1)
        full = flat.numel() // ROW * ROW
        if full:
            block = flat[:full].view(-1, ROW)
            if p == 1.0:  # a plain sum vectorizes its accumulation; the 1-norm kernel does not
                rows.append(block.abs().sum(dim=1, dtype=torch.float32).to(first))
            else:
                rows.append(
                    torch.linalg.vector_norm(block, p, dim=1, dtype=torch.float32).to(first)
                )
        if full < flat.numel():
            rest.append(flat[full:].to(first))
    total = torch.zeros((), dtype=torch.float64, device=first)
    if rows:
        total = total + _pow(torch.cat(rows).double(), p).sum()
    for group in _by_device_dtype(rest).values():  # one concatenation per dtype
        total = total + _pow(torch.cat(group).to(torch.float64).abs(), p).sum()
    return total


def _pow(x: Tensor, p: float) -> Tensor:
    # Exact for p = 1 and 2 (no pow kernel's rounding): the common norms stay reproducible.
    if p == 2.0:
        return x.square()
    return x if p == 1.0 else x.pow(p)


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
    """The norm of all gradients taken as one vector, as a 0-dim fp64 tensor.

    ``norm_type`` is any p >= 1 or ``inf``. The p-th powers are summed in fp64 (see the module
    docstring), across ranks too (the maximum for ``inf``), so the result is the norm of the
    whole model's gradient, the same on every layout to ~1e-9.
    """
    norm_type = float(norm_type)
    grads = _grads(params_or_grads, is_counted)
    if norm_type == float("inf"):
        local = _fp32_norms(grads, norm_type).amax().double() if grads else _zero()
        if reduce_fn is not None:
            local = reduce_fn(local.reshape(1), "max").reshape(())
        return local
    if grads:
        local = _power_sum(grads, norm_type)
    else:
        local = _zero()
    if reduce_fn is not None:
        local = reduce_fn(local.reshape(1), "sum").reshape(())
    if norm_type == 2.0:
        return local.sqrt()
    return local if norm_type == 1.0 else local ** (1.0 / norm_type)


def _zero() -> Tensor:
    return torch.zeros((), dtype=torch.float64)


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
    all gradients are scaled. The coefficient is ``max_norm / (norm + 1e-6)`` (as in
    ``torch.nn.utils.clip_grad_norm_``), computed in fp64 and rounded once to fp32 for the
    multiply; nothing is touched when it is >= 1. Returns the total norm (fp64) before clipping.
    """
    items = list(params_or_grads)
    if total_norm is None:
        total_norm = get_grad_norm(items, norm_type, reduce_fn=reduce_fn, is_counted=is_counted)
    total_norm = torch.as_tensor(total_norm, dtype=torch.float64)
    clip_coef = max_norm / (total_norm + 1e-6)
    if clip_coef < 1.0:
        coef = clip_coef.float()
        for (device, _), group in _by_device_dtype(_grads(items)).items():
            torch._foreach_mul_(group, coef.to(device))
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


def weak_hook(method: Callable[..., Any], *args: Any) -> Callable[[Tensor], None]:
    """``method(*args, param)`` (a bound method) as a parameter hook that holds its object
    weakly.

    A hook registered with ``register_post_accumulate_grad_hook`` lives in autograd's C++
    gradient accumulator once a backward has run, where Python's garbage collector cannot see
    it: an object that holds the parameter and hooks a bound method of its own onto it is then
    a cycle gc never frees, and a dropped optimizer or gradient reducer would keep its buffers
    (fp32 masters, Adam moments, buckets) until the process exits. Through this wrapper the hook
    does nothing once its object is gone.
    """
    ref = weakref.WeakMethod(method)

    def hook(param: Tensor) -> None:
        bound = ref()
        if bound is not None:
            bound(*args, param)

    return hook
