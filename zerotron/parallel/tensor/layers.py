"""Tensor-parallel layers: Megatron-LM's column/row split of linear layers and embeddings.

A linear layer ``Y = X A^T`` splits two ways (Megatron-LM paper, section 3):

- :class:`ColumnParallelLinear` splits ``A`` along its output dimension: each rank computes a
  slice of ``Y``; ``gather_output`` all-gathers the slices.
- :class:`RowParallelLinear` splits ``A`` along its input dimension: each rank multiplies its slice
  of ``X`` and the partial results are all-reduced (the bias is added after the sum).
- :class:`VocabParallelEmbedding` splits the embedding table by vocabulary rows; a rank looks up
  the ids it holds, zeros the others, and the partial embeddings are all-reduced.

Sequence parallelism (Korthikanti et al. 2022, ``sequence_parallel=True``): outside the TP
regions activations are split along the sequence (dim 1 of ``[b, s, h]``). A column-parallel
layer all-gathers its input along the sequence instead of copying it, a row-parallel layer and
the embedding reduce-scatter their output along the sequence instead of all-reducing it. The
parameters that then see only a sequence shard yet are replicated (LayerNorms, the row-parallel
bias, position embeddings) carry ``sequence_parallel = True``; their gradients are partial and
:func:`~zerotron.parallel.tensor.sequence_parallel.allreduce_sequence_parallel_grads` sums them.

Initialization does not depend on the TP size: a layer creates the *full* (master) weight with
the caller's ``init_method`` and keeps this rank's partition, so a TP>1 layout assembles to the
TP=1 weight for the same seed. Parameters carry Megatron-core's attributes
(``tensor_model_parallel``, ``partition_dim``, ``partition_stride``) so optimizers, checkpoints and
gradient clipping can find the split ones.

The TP group is ``zerotron.distributed.state().tp`` unless ``tp_group`` is given; ``tp_size`` /
``tp_rank``, if given, must agree with it. At TP=1 the layers are plain ``F.linear`` /
``F.embedding`` (no communication, no extra autograd nodes); fp32 matmuls on CPU go to oneDNN
(:func:`~zerotron.kernels.onednn.linear`, as the kernel policy says).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from zerotron.distributed.comm import Group
from zerotron.distributed.state import state
from zerotron.errors import UnsupportedError
from zerotron.kernels.onednn import linear
from zerotron.parallel.tensor.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from zerotron.parallel.tensor.overlap import (
    fused_path_applies,
    linear_with_async_grad_comm,
    overlap_enabled,
)

InitMethod = Callable[[torch.Tensor], object]


def init_method_normal(std: float) -> InitMethod:
    """``N(0, std)``: Megatron's default init for weights."""
    return lambda tensor: nn.init.normal_(tensor, mean=0.0, std=std)


def scaled_init_method_normal(std: float, num_layers: int) -> InitMethod:
    """``N(0, std / sqrt(2 * num_layers))``: GPT-2's init for outputs into the residual stream."""
    return init_method_normal(std / (2.0 * num_layers) ** 0.5)


def resolve_tp_group(
    tp_group: Group | None, tp_size: int | None, tp_rank: int | None, layer: str
) -> Group:
    """The TP group a layer talks to: ``tp_group`` or ``state().tp``, checked against the
    ``tp_size`` / ``tp_rank`` the caller asked for."""
    group = state().tp if tp_group is None else tp_group
    size = group.size if tp_size is None else tp_size
    rank = group.rank if tp_rank is None else tp_rank
    if (size, rank) != (group.size, group.rank):
        raise UnsupportedError(
            f"tensor parallelism with tp_size={size}, tp_rank={rank} does not match the "
            f"tensor-parallel group (size {group.size}, this rank {group.rank})",
            where=layer,
            fix="call initialize_model_parallel(tp) first and leave tp_size/tp_rank unset, "
            "or pass tp_group",
        )
    return group


class _SharedGroup:
    """Holds a :class:`Group`; deep copies share it (a torch ProcessGroup cannot be copied, and a
    copied layer, e.g. a pipeline stage cut from a model, talks to the same ranks)."""

    __slots__ = ("group",)

    def __init__(self, group: Group):
        self.group = group

    def __deepcopy__(self, memo: dict) -> _SharedGroup:
        return self


def tp_group_attribute() -> property:
    """The ``tp_group`` attribute of a module: a :class:`Group` that survives ``deepcopy``."""

    def get(module: nn.Module) -> Group:
        return module.__dict__["_tp_group_ref"].group

    def set_(module: nn.Module, group: Group) -> None:
        module.__dict__["_tp_group_ref"] = _SharedGroup(group)

    return property(get, set_, doc="The tensor-parallel group this module talks to.")


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
    init_rows: int | None = None,
) -> None:
    """Initialize the full weight in fp32 (default ``N(0, 0.02)``), then keep this rank's partition.

    With ``stride`` s the dimension is cut into ``tp_size * s`` chunks and rank r keeps chunks
    r, r + tp_size, ... (for weights made of s interleaved blocks). With ``init_rows`` only the
    first rows are drawn and the rest are zero, so the random numbers consumed (and every later
    layer's initialization) do not depend on how far the rows were padded.
    """
    master = torch.zeros(full_shape, dtype=torch.float32, device=weight.device)
    (init_method or init_method_normal(0.02))(master if init_rows is None else master[:init_rows])
    chunks = torch.chunk(master, tp_size * stride, dim=partition_dim)
    mine = torch.cat(chunks[tp_rank::tp_size], dim=partition_dim)
    with torch.no_grad():
        weight.copy_(mine)


class ColumnParallelLinear(nn.Module):
    """``Y = X A^T + b`` with ``A`` split along its output dimension (rows of ``weight``).

    Input: the full ``X`` (replicated on the TP ranks), or with ``sequence_parallel`` this
    rank's sequence shard ``[b, s/tp, in]``, all-gathered here. Output: this rank's columns
    ``[..., out/tp]``, or all of them with ``gather_output``.

    The backward overlaps the input gradient's all-reduce (reduce-scatter under sequence
    parallelism) with the weight gradient (:mod:`~zerotron.parallel.tensor.overlap`; same
    bits), unless ``overlap_grad_comm`` is False or ``ZEROTRON_TP_OVERLAP=0``.
    """

    tp_group = tp_group_attribute()

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = True,
        gather_output: bool = True,
        init_method: InitMethod | None = None,
        stride: int = 1,
        sequence_parallel: bool = False,
        tp_size: int | None = None,
        tp_rank: int | None = None,
        tp_group: Group | None = None,
        overlap_grad_comm: bool = True,
    ):
        super().__init__()
        self.tp_group = resolve_tp_group(tp_group, tp_size, tp_rank, "ColumnParallelLinear")
        self.overlap_grad_comm = overlap_grad_comm
        tp_size, tp_rank = self.tp_group.size, self.tp_group.rank
        self.input_size, self.output_size = input_size, output_size
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel and tp_size > 1
        if self.sequence_parallel and gather_output:
            raise UnsupportedError(
                "ColumnParallelLinear with sequence_parallel and gather_output",
                fix="keep the output split (gather_output=False) under sequence parallelism",
            )
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
        if self.tp_group.size == 1:
            return linear(input_, self.weight, self.bias)
        if (
            self.overlap_grad_comm
            and overlap_enabled()
            and fused_path_applies(input_, self.weight, self.bias)
        ):
            y = linear_with_async_grad_comm(
                input_, self.weight, self.bias, self.tp_group, self.sequence_parallel
            )
        else:
            if self.sequence_parallel:
                x = gather_from_sequence_parallel_region(input_, self.tp_group)
            else:
                x = copy_to_tensor_model_parallel_region(input_, self.tp_group)
            y = linear(x, self.weight, self.bias)
        return (
            gather_from_tensor_model_parallel_region(y, self.tp_group) if self.gather_output else y
        )

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"


class RowParallelLinear(nn.Module):
    """``Y = X A^T + b`` with ``A`` split along its input dimension (columns of ``weight``).

    Input: this rank's slice of ``X``'s last dim (``input_is_parallel``), else the full ``X``,
    split here. The partial products are all-reduced (with ``sequence_parallel``
    reduce-scattered along the sequence); the bias is not split and is added once, after the
    sum (under sequence parallelism it then sees only this rank's tokens: its gradient is
    marked ``sequence_parallel``).
    """

    tp_group = tp_group_attribute()

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = True,
        input_is_parallel: bool = False,
        init_method: InitMethod | None = None,
        stride: int = 1,
        sequence_parallel: bool = False,
        tp_size: int | None = None,
        tp_rank: int | None = None,
        tp_group: Group | None = None,
    ):
        super().__init__()
        self.tp_group = resolve_tp_group(tp_group, tp_size, tp_rank, "RowParallelLinear")
        tp_size, tp_rank = self.tp_group.size, self.tp_group.rank
        self.input_size, self.output_size = input_size, output_size
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel and tp_size > 1
        if self.sequence_parallel and not input_is_parallel:
            raise UnsupportedError(
                "RowParallelLinear with sequence_parallel needs input_is_parallel=True",
                fix="feed it the output of a ColumnParallelLinear",
            )
        self.input_size_per_partition = divide(input_size, tp_size, "input size")
        self.weight = nn.Parameter(torch.empty(output_size, self.input_size_per_partition))
        _init_partition(
            self.weight, (output_size, input_size), 1, init_method, tp_size, tp_rank, stride
        )
        set_tensor_model_parallel_attributes(self.weight, True, 1, stride)
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size))
            if self.sequence_parallel:
                self.bias.sequence_parallel = True
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        if self.tp_group.size == 1:
            return linear(input_, self.weight, self.bias)
        x = input_
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, self.tp_group)
        y = linear(x, self.weight, None)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.tp_group)
        else:
            y = reduce_from_tensor_model_parallel_region(y, self.tp_group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"


class VocabParallelEmbedding(nn.Module):
    """An embedding table split by vocabulary rows: rank r holds ids ``[start, end)``.

    Output: the full embeddings ``[b, s, h]`` on every TP rank, or with ``sequence_parallel``
    this rank's sequence shard ``[b, s/tp, h]`` (reduce-scatter instead of all-reduce).
    """

    tp_group = tp_group_attribute()

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        init_method: InitMethod | None = None,
        init_rows: int | None = None,
        sequence_parallel: bool = False,
        tp_size: int | None = None,
        tp_rank: int | None = None,
        tp_group: Group | None = None,
    ):
        """``init_rows``: the real vocabulary; padding rows beyond it start at zero."""
        super().__init__()
        self.tp_group = resolve_tp_group(tp_group, tp_size, tp_rank, "VocabParallelEmbedding")
        tp_size, tp_rank = self.tp_group.size, self.tp_group.rank
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.sequence_parallel = sequence_parallel and tp_size > 1
        per_partition = divide(num_embeddings, tp_size, "vocabulary size")
        self.vocab_start_index = tp_rank * per_partition
        self.vocab_end_index = self.vocab_start_index + per_partition
        self.weight = nn.Parameter(torch.empty(per_partition, embedding_dim))
        _init_partition(
            self.weight,
            (num_embeddings, embedding_dim),
            0,
            init_method,
            tp_size,
            tp_rank,
            init_rows=init_rows,
        )
        set_tensor_model_parallel_attributes(self.weight, True, 0)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        if self.tp_group.size == 1:
            return F.embedding(input_, self.weight)
        outside = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
        local = (input_ - self.vocab_start_index).masked_fill(outside, 0)
        partial = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)
        return reduce_from_tensor_model_parallel_region(partial, self.tp_group)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"
