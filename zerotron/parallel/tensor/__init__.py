"""Tensor and sequence model parallelism (Megatron-LM): split linear layers, embeddings, the loss.

- :mod:`~zerotron.parallel.tensor.mappings`: the collectives as autograd functions (copy /
  reduce / scatter / gather to and from the TP region, and the sequence-parallel twins).
- :mod:`~zerotron.parallel.tensor.layers`: :class:`ColumnParallelLinear`,
  :class:`RowParallelLinear`, :class:`VocabParallelEmbedding`.
- :mod:`~zerotron.parallel.tensor.cross_entropy`: :func:`vocab_parallel_cross_entropy`.
- :mod:`~zerotron.parallel.tensor.sequence_parallel`:
  :func:`allreduce_sequence_parallel_grads` (LayerNorm-like parameters under
  ``--sequence-parallel``).
"""

from zerotron.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from zerotron.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    init_method_normal,
    scaled_init_method_normal,
    set_tensor_model_parallel_attributes,
    tp_group_attribute,
)
from zerotron.parallel.tensor.mappings import (
    SEQUENCE_DIM,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from zerotron.parallel.tensor.sequence_parallel import (
    allreduce_sequence_parallel_grads,
    mark_sequence_parallel,
    sequence_parallel_params,
)

__all__ = [
    "SEQUENCE_DIM",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "allreduce_sequence_parallel_grads",
    "copy_to_tensor_model_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "init_method_normal",
    "mark_sequence_parallel",
    "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "scaled_init_method_normal",
    "sequence_parallel_params",
    "set_tensor_model_parallel_attributes",
    "tp_group_attribute",
    "vocab_parallel_cross_entropy",
]
