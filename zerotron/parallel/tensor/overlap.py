"""A column-parallel linear whose input-gradient collective overlaps the weight gradient.

In a :class:`~zerotron.parallel.tensor.layers.ColumnParallelLinear` the backward pass computes
two products from the output gradient ``g``: the input gradient ``g W`` and the weight gradient
``g^T X``. Only the first needs communication (an all-reduce over the TP group, or under
sequence parallelism a reduce-scatter along the sequence), and nothing in the weight gradient
waits for it. Written as the two mapping functions around a linear, autograd computes both
products and only then communicates; :class:`_LinearWithAsyncGradComm` computes ``g W``, starts
its collective through :mod:`zerotron.distributed.comm` (ledger, liveness count and watchdog
mark included), computes ``g^T X`` while it travels, and waits. This is Megatron-LM's
``async_tensor_model_parallel_allreduce`` (``LinearWithGradAccumulationAndAsyncCommunication``),
and its reduce-scatter analogue under sequence parallelism.

Exact: each product is the same kernel call on the same operands as on the plain path
(:func:`zerotron.kernels.onednn.linear`'s oneDNN matmuls for fp32 CPU tensors, its upcast fp32
matmuls for 16-bit ones where the policy says so, else the matmuls autograd derives for
``F.linear``), the collective is the same ``comm`` call on the same
tensor, so the gradients are bit-identical (tests/distributed/test_tp_overlap.py checks it).
Under autocast the plain path runs (autocast picks the matmul's dtype; the fused function would
have to repeat that choice).

On by default; ``ZEROTRON_TP_OVERLAP=0`` (read at every forward) or a layer's
``overlap_grad_comm = False`` turns it off. Megatron's ``--no-async-tensor-model-parallel-
allreduce`` is the same switch.
"""

from __future__ import annotations

import os

import torch

from zerotron.distributed import comm
from zerotron.distributed.comm import Group
from zerotron.kernels.onednn import _mm_t_op, use_onednn
from zerotron.kernels.upcast import linear_product, use_upcast
from zerotron.kernels.upcast import mm as upcast_mm
from zerotron.parallel.tensor.mappings import SEQUENCE_DIM

ENV_SWITCH = "ZEROTRON_TP_OVERLAP"


def overlap_enabled() -> bool:
    """Whether column-parallel layers overlap their input-gradient collective (the default);
    ``ZEROTRON_TP_OVERLAP=0`` turns it off."""
    return os.environ.get(ENV_SWITCH, "1") != "0"


def fused_path_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether :func:`linear_with_async_grad_comm` reproduces the plain path's bits for these
    operands: floating point, a contiguous input of at least 2 dims (aten's linear takes another
    route for others), no autocast."""
    return (
        x.dim() >= 2
        and x.is_contiguous()
        and x.is_floating_point()
        and x.dtype == weight.dtype
        and (bias is None or bias.dtype == weight.dtype)
        and not torch.is_autocast_enabled(x.device.type)
    )


class _LinearWithAsyncGradComm(torch.autograd.Function):
    """``y = gather(x) W^T + b``; backward: start the collective on ``g W``, compute ``g^T X``.

    ``x`` is this rank's input: the full ``X`` (``sequence_parallel`` False; the backward
    all-reduces the input gradient) or its sequence shard (gathered here; the backward
    reduce-scatters). The gathered ``X`` is saved, as the plain path's linear saves it.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel):
        total = comm.all_gather(x, group, dim=SEQUENCE_DIM) if sequence_parallel else x
        x2 = total.reshape(-1, total.shape[-1])
        onednn = use_onednn(x2) and use_onednn(weight)
        upcast = use_upcast(x2)
        ctx.onednn, ctx.upcast = onednn, upcast
        ctx.group, ctx.sequence_parallel = group, sequence_parallel
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x2, weight)
        if onednn:  # as zerotron.kernels.onednn._OneDNNLinear.forward
            y = _mm_t_op(x2, weight)
            y = y if bias is None else y.add_(bias)
        elif upcast:  # as zerotron.kernels.upcast._UpcastLinear.forward
            y = linear_product(x2, weight, bias)
        else:  # as aten's linear on a 2-D input
            y = torch.addmm(bias, x2, weight.t()) if bias is not None else x2.mm(weight.t())
        return y.view(*total.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_y):
        x2, weight = ctx.saved_tensors
        g = grad_y.reshape(-1, grad_y.shape[-1])
        shape = (*grad_y.shape[:-1], weight.shape[1])
        pending = grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            if ctx.onednn:
                grad_x = _mm_t_op(g, weight.t())
            elif ctx.upcast:
                grad_x = upcast_mm(g, weight).to(g.dtype)
            else:
                grad_x = g.mm(weight)
            grad_x = grad_x.view(shape)
            if ctx.sequence_parallel:
                pending = comm.reduce_scatter_async(grad_x, ctx.group, dim=SEQUENCE_DIM)
            else:  # grad_x is this function's own fresh tensor: reduced in place, no copy
                pending = comm.all_reduce_async(grad_x, ctx.group)
        # The weight and bias gradients are computed while the collective travels.
        if ctx.needs_input_grad[1]:
            if ctx.onednn:
                grad_w = _mm_t_op(g.t(), x2.t())
            elif ctx.upcast:
                grad_w = upcast_mm(g.t(), x2).to(weight.dtype)
            else:
                grad_w = g.t().mm(x2)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.sum(0)
        if pending is not None:
            grad_x = pending.wait()
        return grad_x, grad_w, grad_b, None, None


def linear_with_async_grad_comm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: Group,
    sequence_parallel: bool,
) -> torch.Tensor:
    """A column-parallel layer's linear: ``copy_to`` (or the sequence gather) and ``linear`` in
    one autograd node whose backward overlaps the input-gradient collective with the weight
    gradient. Call only where :func:`fused_path_applies`."""
    return _LinearWithAsyncGradComm.apply(x, weight, bias, group, sequence_parallel)
