"""16-bit matmuls on a CPU without 16-bit matmul instructions: the fp32 GEMM on upcast copies.

Without AVX-512 BF16 or AMX (an AVX2 AMD EPYC Zen 3, for one) torch's bf16 and fp16 GEMMs on
CPU are emulated: 8.4 GFLOP/s against the fp32 GEMM's 66 on one Zen 3 core, upcast copies
included (``[2048, 384] @ [384, 1536]``, bench/README.md). A product of two 16-bit numbers is
exact in fp32, so taking both operands to fp32, multiplying with the fp32 GEMM (fp32 sums) and
rounding the result to 16 bits once computes what a native 16-bit GEMM computes, fp32 sums of
exact products rounded once, up to the order of the sums (as any two GEMMs differ). A bias is
added in fp32 before the rounding. The kernel choice ``matmul16`` picks this path (``fp32``) or
torch's own (``native``) by timing both on the machine (:mod:`~zerotron.kernels.chooser`); the
kernel policy's ``upcast_16bit`` says where it runs (``ZEROTRON_UPCAST_16BIT=0`` turns it off).

- :func:`use_upcast`: whether a tensor's matmuls go here (16-bit, CPU, the policy says so).
- :func:`linear`: ``F.linear`` for 16-bit 2-D inputs with its forward and both backward
  matmuls upcast; the linear layers reach it through :func:`zerotron.kernels.onednn.linear`.
- :func:`mm`: ``a @ b`` of 16-bit operands, the product left in fp32 (the fused loss keeps its
  logits and sums in fp32 anyway).

What it costs: the fp32 copies are transient (one layer's weight and activations at a time),
except in the fused loss, which keeps an fp32 copy of the output layer's weight and an fp32
sum of its gradient in its workspace (two ``[V, h]`` fp32 buffers).
"""

from __future__ import annotations

import torch
from torch import Tensor

from zerotron.kernels.policy import kernel_policy

SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def use_upcast(t: Tensor) -> bool:
    """Whether ``t``'s matmuls go to the fp32 GEMM: 16-bit, and the device's kernel policy
    says so (the CPU where the choice ``matmul16`` is ``fp32``)."""
    return t.dtype in SIXTEEN_BIT and kernel_policy(t.device).upcast_16bit


def mm(a: Tensor, b: Tensor, out: Tensor | None = None) -> Tensor:
    """``a @ b`` in fp32 (into ``out``, fp32, if given): either operand 16-bit or fp32."""
    return torch.mm(a.float(), b.float(), out=out)


def linear_product(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``x W^T + b`` for 2-D ``x``, computed in fp32 and rounded to ``x``'s dtype once."""
    if bias is None:
        return mm(x, weight.t()).to(x.dtype)
    return torch.addmm(bias.float(), x.float(), weight.float().t()).to(x.dtype)


class _UpcastLinear(torch.autograd.Function):
    """``y = x W^T + b`` for 2-D 16-bit ``x``; backward ``grad_x = g W``, ``grad_W = g^T x``,
    ``grad_b = sum(g)``, each matmul on fp32 copies and rounded to ``x``'s dtype once."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return linear_product(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = mm(grad_y, weight).to(x.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = mm(grad_y.t(), x).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_y.sum(0)
        return grad_x, grad_w, grad_b


def linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``F.linear(x, weight, bias)`` for 16-bit tensors of one dtype, matmuls upcast (see the
    module docstring); ``x`` of any rank >= 2."""
    y = _UpcastLinear.apply(x.reshape(-1, x.shape[-1]), weight, bias)
    return y.view(*x.shape[:-1], weight.shape[0])
