"""fp32 matmuls on CPU by oneDNN rather than torch.mm (MKL), where oneDNN is there.

torch.mm's fp32 GEMM on CPU is MKL, which on AMD CPUs runs its AVX2 code; oneDNN's runs
AVX-512 there (the rates are in bench/README.md; 16-bit torch.mm already is oneDNN, so only fp32
is routed here). Results equal torch.mm's up to summation order.

- :func:`use_onednn`: whether a tensor's matmuls go here (fp32, CPU, oneDNN built in, and the
  kernel policy's ``onednn_linear``: ``ZEROTRON_ONEDNN=0`` turns it off).
- :func:`onednn_mm_t`: ``a @ b^T`` for 2-D tensors of any strides, eager (the fused loss).
- :func:`onednn_mm_t_into`: ``out = a @ b^T`` (or ``out += a @ b^T``) in slices of ``b``'s rows,
  for products too large to come out of oneDNN fresh (see its docstring).
- :func:`linear`: ``F.linear`` with its forward and both backward matmuls on oneDNN where
  :func:`use_onednn` holds (and autocast is off), on the fp32 GEMM for 16-bit tensors where
  :func:`~zerotron.kernels.upcast.use_upcast` holds, else ``F.linear`` itself. Under
  ``torch.compile`` the matmul is the opaque custom op ``zerotron::onednn_mm_t`` (inductor's own
  lowering of ``mkldnn._linear_pointwise`` only handles constant, frozen weights), so the graph
  does not break around it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zerotron.kernels.policy import kernel_policy
from zerotron.kernels.upcast import linear as upcast_linear
from zerotron.kernels.upcast import use_upcast

ONEDNN_AVAILABLE = torch.backends.mkldnn.is_available() and hasattr(
    torch.ops.mkldnn, "_linear_pointwise"
)


def use_onednn(t: torch.Tensor) -> bool:
    """Whether ``t``'s matmuls go to oneDNN: fp32, oneDNN built in, and the device's kernel
    policy says so (the CPU, unless ``ZEROTRON_ONEDNN=0``)."""
    return ONEDNN_AVAILABLE and t.dtype == torch.float32 and kernel_policy(t.device).onednn_linear


def onednn_mm_t(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b^T`` by oneDNN (2-D, any strides) into a fresh contiguous tensor."""
    return torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")


def onednn_mm_t_into(
    out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows_per_call: int, add: bool = False
) -> torch.Tensor:
    """``out = a @ b^T`` (``out += a @ b^T`` with ``add``) by oneDNN, ``rows_per_call`` rows of
    ``b`` (columns of ``out``) per call, each call's small fresh result copied into ``out``.

    oneDNN has no ``out=``: a large product comes out in fresh memory, and on CPU an allocation
    above glibc's mmap threshold (32 MB at most) is a fresh mapping whose every page faults on
    first touch (for the fused loss's ``[512, 50257]`` fp32 logits, a third of the GEMM's own
    time on bench/README.md's CPU). Results of a few MB are served from the heap,
    reused from one call to the next; the copy into ``out`` costs far less than the faults. Each
    element is the same dot product as in one call (the slices split ``out``'s columns, not the
    sum).
    """
    n = b.shape[0]
    step = max(1, rows_per_call)
    for start in range(0, n, step):
        cols = slice(start, min(start + step, n))
        part = onednn_mm_t(a, b[cols])
        if add:
            out[:, cols].add_(part)
        else:
            out[:, cols].copy_(part)
    return out


@torch.library.custom_op("zerotron::onednn_mm_t", mutates_args=())
def _mm_t_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return onednn_mm_t(a, b)


@_mm_t_op.register_fake
def _(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.new_empty(a.shape[0], b.shape[0])


class _OneDNNLinear(torch.autograd.Function):
    """``y = x W^T + b`` for 2-D ``x``; backward ``grad_x = g W``, ``grad_W = g^T x``."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        y = _mm_t_op(x, weight)
        if bias is None:
            return y
        # Out of place when traced: torch 2.11's compile gives zero gradients through an add_
        # on the custom op's output (2.12 and 2.13 do not); inductor fuses the add either way.
        return y + bias if torch.compiler.is_compiling() else y.add_(bias)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _mm_t_op(grad_y, weight.t())
        if ctx.needs_input_grad[1]:
            grad_w = _mm_t_op(grad_y.t(), x.t())
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_y.sum(0)
        return grad_x, grad_w, grad_b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, on oneDNN for fp32 CPU tensors (see the module docstring)
    and on the fp32 GEMM for 16-bit ones where the policy says so
    (:func:`zerotron.kernels.upcast.linear`).

    Autocast keeps ``F.linear`` (it may cast the matmul to 16 bits, the custom op would not).
    """
    if x.dim() < 2 or torch.is_autocast_enabled("cpu"):
        return F.linear(x, weight, bias)
    if use_upcast(x) and weight.dtype == x.dtype and (bias is None or bias.dtype == x.dtype):
        return upcast_linear(x, weight, bias)
    if not (use_onednn(x) and use_onednn(weight) and (bias is None or bias.dtype == torch.float32)):
        return F.linear(x, weight, bias)
    y = _OneDNNLinear.apply(x.reshape(-1, x.shape[-1]), weight, bias)
    return y.view(*x.shape[:-1], weight.shape[0])
