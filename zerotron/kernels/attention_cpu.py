"""16-bit causal attention on CPU: SDPA's MATH backend kept in 16 bits, as one custom op.

On CPU ``F.scaled_dot_product_attention`` runs its flash kernel, which is slow in 16 bits, its
backward above all; the MATH backend (two matmuls and a softmax) is slower still as SDPA runs it,
upcast to fp32, and about twice as fast as flash kept in 16 bits (per-layer timings in
bench/README.md). SDPA keeps MATH in 16 bits only under
``torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp``, a process-wide flag (it governs the
CPU too) that dynamo cannot trace: toggled around a call inside a compiled model, it breaks the
graph at every layer.

So :func:`sdpa_math_16bit` is a ``torch.library`` custom op: its forward runs SDPA's own MATH
kernel (``aten::_scaled_dot_product_attention_math``) with the flag set for that call only and
restored, and returns the output and the probabilities; its backward is the MATH backward
written out (the ops autograd would run through it), from the saved probabilities. Compiled,
the op is opaque (no graph break) and its backward's matmuls are traced into the backward graph.

Numerics are Megatron-LM's unfused attention in 16 bits: ``q`` and ``k`` scaled by
``d^-1/4`` each, scores and probabilities stored in 16 bits, the softmax computed in fp32 within
the kernel. No dropout here (:func:`~zerotron.models.gpt._core_attention` leaves attention
dropout to SDPA's own path). The kernel policy's ``attention_16bit`` chooses it (the CPU;
``ZEROTRON_MATH_ATTENTION=0`` turns it off).

Where 16-bit matmuls are emulated (no AVX-512 BF16, no AMX) both 16-bit kernels are slow, and
:func:`sdpa_fp32`, SDPA on fp32 copies rounded back, is the third candidate of the kernel
choice ``attention`` (the policy's ``attention_fp32``, the same off switch).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


@torch.library.custom_op("zerotron::sdpa_math_16bit", mutates_args=())
def _forward(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, is_causal: bool
) -> tuple[Tensor, Tensor]:
    allowed = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
    try:
        out, probs = torch.ops.aten._scaled_dot_product_attention_math(
            q, k, v, attn_mask, 0.0, is_causal
        )
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(allowed)
    return out.contiguous(), probs


@_forward.register_fake
def _(q, k, v, attn_mask, is_causal):
    b, heads, s_q, _ = q.shape
    out = q.new_empty(b, heads, s_q, v.shape[-1])
    return out, q.new_empty(b, heads, s_q, k.shape[-2])


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, _, _ = inputs
    _, probs = output
    ctx.save_for_backward(q, k, v, probs)


def _backward(ctx, grad_out: Tensor, _grad_probs: Tensor | None):
    q, k, v, probs = ctx.saved_tensors
    root = 1.0 / math.sqrt(math.sqrt(q.shape[-1]))  # MATH scales q and k by d^-1/4 each
    grad_v = probs.transpose(-2, -1) @ grad_out
    grad_probs = grad_out @ v.transpose(-2, -1)
    grad_scores = torch.ops.aten._softmax_backward_data(grad_probs, probs, -1, probs.dtype)
    # as autograd runs MATH's backward: both products from the scaled q and k^T, grad_k
    # transposed back (a view)
    grad_q = (grad_scores @ (k.transpose(-2, -1) * root).transpose(-2, -1)) * root
    grad_k = (((q * root).transpose(-2, -1) @ grad_scores) * root).transpose(-2, -1)
    return grad_q, grad_k, grad_v, None, None


_forward.register_autograd(_backward, setup_context=_setup_context)


def sdpa_math_16bit(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None, is_causal: bool = False
) -> Tensor:
    """``F.scaled_dot_product_attention(q, k, v, attn_mask, is_causal=...)`` (no dropout, default
    scale) by SDPA's MATH kernel in ``q``'s 16-bit dtype; see the module docstring."""
    return _forward(q, k, v, attn_mask, is_causal)[0]


def sdpa_fp32(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None, is_causal: bool = False
) -> Tensor:
    """``F.scaled_dot_product_attention`` (no dropout, default scale) of 16-bit ``q``, ``k``,
    ``v`` computed on fp32 copies and rounded to their dtype once; autograd goes through the
    casts, so the gradients are SDPA's fp32 ones rounded once too.

    For a CPU without 16-bit matrix instructions, where SDPA's 16-bit flash kernel runs emulated
    16-bit GEMMs: on an AVX2 Zen 3 core, 51 ms against 235 ms forward and backward on
    ``[8, 6, 256, 64]`` (bench/README.md). Like the 16-bit flash kernel it computes the softmax and
    its sums in fp32; unlike it, the probabilities stay fp32 for the second product. The copies
    it saves for backward are fp32: twice the 16-bit kernels' bytes for q, k, v and the output.
    """
    floating = attn_mask is not None and attn_mask.is_floating_point()
    mask = attn_mask.float() if floating else attn_mask  # a boolean mask stays as it is
    out = F.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=mask, is_causal=is_causal
    )
    return out.to(q.dtype)
