"""The communication of tensor and sequence parallelism, as small autograd functions.

Each function is one collective in forward and its adjoint in backward, written side by side
(Megatron-LM's ``mappings``; Korthikanti et al. 2022 for the sequence-parallel twins):

==========================================  ==========================  ==========================
function                                    forward                     backward
==========================================  ==========================  ==========================
``copy_to_tensor_model_parallel_region``    identity                    all-reduce
``reduce_from_tensor_model_parallel_region``  all-reduce                identity
``scatter_to_tensor_model_parallel_region`` split last dim, keep mine   all-gather last dim
``gather_from_tensor_model_parallel_region``  all-gather last dim       split last dim
``scatter_to_sequence_parallel_region``     split seq dim, keep mine    all-gather seq dim
``gather_from_sequence_parallel_region``    all-gather seq dim          reduce-scatter seq dim
``reduce_scatter_to_sequence_parallel_region``  reduce-scatter seq dim  all-gather seq dim
==========================================  ==========================  ==========================

Tensors are batch-first, ``[b, s, h]``: the sequence dimension is **1** (:data:`SEQUENCE_DIM`).
Megatron-LM keeps ``[s, b, h]`` and splits dim 0; the algebra is the same.

Every call goes through :mod:`zerotron.distributed.comm`, so the byte ledger sees it. With a
one-rank group each function returns its input untouched (no autograd node, no copy), so a TP=1
model pays nothing. ``group`` defaults to this rank's tensor-parallel group
(``zerotron.distributed.state().tp``).
"""

from __future__ import annotations

import torch

from zerotron.distributed import comm
from zerotron.distributed.comm import Group
from zerotron.distributed.state import state
from zerotron.errors import DistributedError

SEQUENCE_DIM = 1  # [b, s, h]


def _tp_group(group: Group | None) -> Group:
    return state().tp if group is None else group


def _split(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """This rank's chunk of ``x`` along ``dim`` (contiguous)."""
    if x.shape[dim] % group.size:
        raise DistributedError(
            f"cannot split dim {dim} of size {x.shape[dim]} (shape {tuple(x.shape)}) across "
            f"{group.size} {group.name} ranks",
            where="parallel.tensor.mappings",
            fix="make the dimension divisible by the tensor-parallel size "
            "(hidden sizes; seq_length under --sequence-parallel)",
        )
    return x.chunk(group.size, dim=dim)[group.rank].contiguous()


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    # comm reduces in place; the caller's tensor may be shared (e.g. a grad that AddBackward
    # hands to two branches), so reduce a private copy.
    return comm.all_reduce(x.clone(memory_format=torch.contiguous_format), group)


class _CopyToTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, group, -1)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_gather(grad, ctx.group, dim=-1), None


class _GatherFromTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.all_gather(x, group, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.group, -1), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, group, SEQUENCE_DIM)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_gather(grad, ctx.group, dim=SEQUENCE_DIM), None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, tensor_parallel_output_grad):
        ctx.group = group
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return comm.all_gather(x, group, dim=SEQUENCE_DIM)

    @staticmethod
    def backward(ctx, grad):
        if ctx.tensor_parallel_output_grad:
            # Each rank's consumer (a column-parallel matmul) produced a partial gradient of
            # the full sequence: sum them, and keep this rank's sequence chunk.
            out = comm.reduce_scatter(grad.contiguous(), ctx.group, dim=SEQUENCE_DIM)
        else:  # the consumer was replicated: every rank already has the full gradient
            out = _split(grad, ctx.group, SEQUENCE_DIM)
        return out, None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.reduce_scatter(x.contiguous(), group, dim=SEQUENCE_DIM)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_gather(grad, ctx.group, dim=SEQUENCE_DIM), None


def copy_to_tensor_model_parallel_region(x: torch.Tensor, group: Group | None = None):
    """Forward: identity. Backward: all-reduce (the input feeds a split computation)."""
    g = _tp_group(group)
    return x if g.size == 1 else _CopyToTensorParallelRegion.apply(x, g)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group: Group | None = None):
    """Forward: all-reduce (sum the partial results). Backward: identity."""
    g = _tp_group(group)
    return x if g.size == 1 else _ReduceFromTensorParallelRegion.apply(x, g)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group: Group | None = None):
    """Forward: keep this rank's chunk of the last dim. Backward: all-gather the last dim."""
    g = _tp_group(group)
    return x if g.size == 1 else _ScatterToTensorParallelRegion.apply(x, g)


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group: Group | None = None):
    """Forward: all-gather the last dim. Backward: keep this rank's chunk of it."""
    g = _tp_group(group)
    return x if g.size == 1 else _GatherFromTensorParallelRegion.apply(x, g)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group | None = None):
    """Forward: keep this rank's chunk of the sequence (dim 1). Backward: all-gather it."""
    g = _tp_group(group)
    return x if g.size == 1 else _ScatterToSequenceParallelRegion.apply(x, g)


def gather_from_sequence_parallel_region(
    x: torch.Tensor, group: Group | None = None, tensor_parallel_output_grad: bool = True
):
    """Forward: all-gather the sequence (dim 1). Backward: reduce-scatter it.

    ``tensor_parallel_output_grad=False`` when what consumes the gathered tensor is replicated
    across TP ranks (each rank's gradient is already the full one): backward then only splits.
    """
    g = _tp_group(group)
    if g.size == 1:
        return x
    return _GatherFromSequenceParallelRegion.apply(x, g, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group | None = None):
    """Forward: reduce-scatter along the sequence (dim 1). Backward: all-gather it."""
    g = _tp_group(group)
    return x if g.size == 1 else _ReduceScatterToSequenceParallelRegion.apply(x, g)
