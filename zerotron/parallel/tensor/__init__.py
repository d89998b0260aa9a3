"""Tensor model parallelism (Megatron-LM): split linear layers, embeddings and the loss."""

from zerotron.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    init_method_normal,
    scaled_init_method_normal,
    set_tensor_model_parallel_attributes,
    vocab_parallel_cross_entropy,
)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "init_method_normal",
    "scaled_init_method_normal",
    "set_tensor_model_parallel_attributes",
    "vocab_parallel_cross_entropy",
]
