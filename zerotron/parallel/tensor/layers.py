"""Tensor-parallel layers (Megatron-LM's column/row split) and the vocab-parallel cross entropy.

A linear layer ``Y = X A^T`` splits two ways (Megatron-LM paper, section 3):

- :class:`ColumnParallelLinear` splits ``A`` along its output dimension: each rank computes a
  slice of ``Y``; ``gather_output`` all-gathers the slices.
- :class:`RowParallelLinear` splits ``A`` along its input dimension: each rank multiplies its slice
  of ``X`` and the partial results are all-reduced.
- :class:`VocabParallelEmbedding` splits the embedding table by vocabulary rows.

Today only a tensor-parallel size of 1 is implemented, where these are plain ``F.linear`` /
``F.embedding`` layers; the 3D-parallelism work adds the communication here, without touching the
models. The shapes and initialization already follow the TP layout: a layer creates the *full*
(master) weight with the caller's ``init_method`` and keeps this rank's partition, so a TP>1 layout
assembles to the TP=1 weight for the same seed. Parameters carry Megatron-core's attributes
(``tensor_model_parallel``, ``partition_dim``, ``partition_stride``) so optimizers, checkpoints and
gradient clipping can find the split ones.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from zerotron.errors import UnsupportedError

InitMethod = Callable[[torch.Tensor], object]


def init_method_normal(std: float) -> InitMethod:
    """``N(0, std)``: Megatron's default init for weights."""
    return lambda tensor: nn.init.normal_(tensor, mean=0.0, std=std)


def scaled_init_method_normal(std: float, num_layers: int) -> InitMethod:
    """``N(0, std / sqrt(2 * num_layers))``: GPT-2's init for outputs into the residual stream."""
    return init_method_normal(std / (2.0 * num_layers) ** 0.5)


def _check_tp(tp_size: int, tp_rank: int, layer: str) -> None:
    if tp_size != 1 or tp_rank != 0:
        raise UnsupportedError(
            f"tensor parallelism (tp_size={tp_size}, tp_rank={tp_rank}) is not implemented yet",
            where=layer,
            fix="use --tensor-model-parallel-size 1",
        )


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    """``numerator / denominator``, which must be exact (a dimension split across ranks)."""
    if numerator % denominator:
        raise UnsupportedError(
            f"{what} {numerator} is not divisible by the tensor-parallel size {denominator}",
            fix="choose sizes divisible by --tensor-model-parallel-size",
        )
    return numerator // denominator


def set_tensor_model_parallel_attributes(
    param: torch.Tensor, is_parallel: bool, partition_dim: int, stride: int = 1
) -> None:
    """Mark ``param`` as split across TP ranks along ``partition_dim`` (Megatron-core's names)."""
    param.tensor_model_parallel = is_parallel
    param.partition_dim = partition_dim
    param.partition_stride = stride


def _init_partition(
    weight: torch.Tensor,
    full_shape: tuple[int, int],
    partition_dim: int,
    init_method: InitMethod | None,
    tp_size: int,
    tp_rank: int,
    stride: int = 1,
) -> None:
    """Initialize the full weight in fp32 (default ``N(0, 0.02)``), then keep this rank's partition.

    With ``stride`` s the dimension is cut into ``tp_size * s`` chunks and rank r keeps chunks
    r, r + tp_size, ... (for weights made of s interleaved blocks).
    """
    master = torch.empty(full_shape, dtype=torch.float32, device=weight.device)
    (init_method or init_method_normal(0.02))(master)
    chunks = torch.chunk(master, tp_size * stride, dim=partition_dim)
    mine = torch.cat(chunks[tp_rank::tp_size], dim=partition_dim)
    with torch.no_grad():
        weight.copy_(mine)


class ColumnParallelLinear(nn.Module):
    """``Y = X A^T + b`` with ``A`` split along its output dimension (rows of ``weight``)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = True,
        gather_output: bool = True,
        init_method: InitMethod | None = None,
        stride: int = 1,
        tp_size: int = 1,
        tp_rank: int = 0,
    ):
        super().__init__()
        _check_tp(tp_size, tp_rank, "ColumnParallelLinear")
        self.input_size, self.output_size = input_size, output_size
        self.gather_output = gather_output
        self.output_size_per_partition = divide(output_size, tp_size, "output size")
        self.weight = nn.Parameter(torch.empty(self.output_size_per_partition, input_size))
        _init_partition(
            self.weight, (output_size, input_size), 0, init_method, tp_size, tp_rank, stride
        )
        set_tensor_model_parallel_attributes(self.weight, True, 0, stride)
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.output_size_per_partition))
            set_tensor_model_parallel_attributes(self.bias, True, 0, stride)
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        # TP>1: copy_to_tensor_model_parallel_region before, gather_from_... after if gather_output.
        return F.linear(input_, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"


class RowParallelLinear(nn.Module):
    """``Y = X A^T + b`` with ``A`` split along its input dimension (columns of ``weight``).

    The bias is not split: it is added once, after the partial products are summed.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = True,
        input_is_parallel: bool = False,
        init_method: InitMethod | None = None,
        stride: int = 1,
        tp_size: int = 1,
        tp_rank: int = 0,
    ):
        super().__init__()
        _check_tp(tp_size, tp_rank, "RowParallelLinear")
        self.input_size, self.output_size = input_size, output_size
        self.input_is_parallel = input_is_parallel
        self.input_size_per_partition = divide(input_size, tp_size, "input size")
        self.weight = nn.Parameter(torch.empty(output_size, self.input_size_per_partition))
        _init_partition(
            self.weight, (output_size, input_size), 1, init_method, tp_size, tp_rank, stride
        )
        set_tensor_model_parallel_attributes(self.weight, True, 1, stride)
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size))
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        # TP>1: scatter_to_... before unless input_is_parallel; reduce_from_... before the bias.
        return F.linear(input_, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"


class VocabParallelEmbedding(nn.Module):
    """An embedding table split by vocabulary rows: rank r holds ids ``[start, end)``."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        init_method: InitMethod | None = None,
        tp_size: int = 1,
        tp_rank: int = 0,
    ):
        super().__init__()
        _check_tp(tp_size, tp_rank, "VocabParallelEmbedding")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        per_partition = divide(num_embeddings, tp_size, "vocabulary size")
        self.vocab_start_index = tp_rank * per_partition
        self.vocab_end_index = self.vocab_start_index + per_partition
        self.weight = nn.Parameter(torch.empty(per_partition, embedding_dim))
        _init_partition(
            self.weight, (num_embeddings, embedding_dim), 0, init_method, tp_size, tp_rank
        )
        set_tensor_model_parallel_attributes(self.weight, True, 0)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        # TP>1: mask ids outside [start, end), look up, zero the masked rows, all-reduce.
        return F.embedding(input_, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token ``logsumexp(logits) - logits[target]``, computed in place on ``logits``.

    The logits buffer becomes the softmax, which backward turns into the gradient in place:
    no full-vocabulary copy is made (3x faster than ``F.cross_entropy`` on CPU, which scatters
    into a fresh zero tensor in backward). The caller's ``logits`` are consumed, and backward
    can run once only (no ``retain_graph``). TP>1 adds three all-reduces: the max, the
    predicted logit and the sum of exponentials.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits.sub_(logits.amax(dim=-1, keepdim=True))  # stability: exp never overflows
        predicted = logits.gather(-1, target.unsqueeze(-1)).squeeze(-1)
        logits.exp_()
        sum_exp = logits.sum(dim=-1)
        loss = sum_exp.log() - predicted
        logits.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(logits, target)
        return loss

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        softmax, target = ctx.saved_tensors
        grad = softmax  # d loss / d logits = softmax - one_hot(target)
        minus_one = torch.full_like(target, -1, dtype=grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, target.unsqueeze(-1), minus_one)
        grad.mul_(grad_output.unsqueeze(-1))
        return grad, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-token cross entropy in fp32: ``logits`` [..., V] (any float dtype), ``target`` [...].

    ``logits`` are consumed when already fp32 (they become the saved softmax); pass a copy if
    you still need them.
    """
    shape = target.shape
    logits = logits.reshape(-1, logits.shape[-1]).float()
    loss = _VocabParallelCrossEntropy.apply(logits, target.reshape(-1))
    return loss.view(shape)
