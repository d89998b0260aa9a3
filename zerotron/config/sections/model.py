"""The ``model`` section: the GPT's shape, regularization and activation recomputation."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from zerotron.config.sections.base import Float, Int, Section

# Defaults are Megatron-LM's (megatron/training/arguments.py) where it has one.


class ModelConfig(Section):
    """GPT shape, regularization, activation recomputation."""

    num_layers: Int | None = Field(None, gt=0, description="Number of transformer layers.")
    hidden_size: Int | None = Field(None, gt=0, description="Transformer hidden size.")
    num_attention_heads: Int | None = Field(None, gt=0, description="Number of attention heads.")
    ffn_hidden_size: Int | None = Field(
        None, gt=0, description="MLP hidden size; 4 * hidden_size when not given."
    )
    seq_length: Int | None = Field(None, gt=0, description="Sequence length of a sample.")
    max_position_embeddings: Int | None = Field(
        None, gt=0, description="Number of position embeddings; seq_length when not given."
    )
    make_vocab_size_divisible_by: Int = Field(
        128, gt=0, description="Pad the vocabulary to a multiple of this times the TP size."
    )
    layernorm_epsilon: Float = Field(1e-5, gt=0, description="LayerNorm epsilon.")
    init_method_std: Float = Field(0.02, gt=0, description="Std of the normal weight init.")
    hidden_dropout: Float = Field(0.1, ge=0, lt=1, description="Dropout on hidden states.")
    attention_dropout: Float = Field(0.1, ge=0, lt=1, description="Dropout on attention probs.")
    recompute_granularity: Literal["full", "selective"] | None = Field(
        None,
        description="Activation recomputation: 'full' recomputes whole layers, 'selective' "
        "only the attention core.",
    )
    recompute_method: Literal["uniform", "block"] | None = Field(
        None,
        description="With full recomputation: 'uniform' checkpoints every recompute_num_layers "
        "layers as one unit, 'block' recomputes the first recompute_num_layers layers of each "
        "pipeline stage. Default uniform.",
    )
    recompute_num_layers: Int | None = Field(
        None, gt=0, description="Layers per recompute unit (uniform) or per stage (block); 1."
    )
    checkpoint_activations: bool = Field(
        False,
        description="Megatron-DeepSpeed's full recompute: --recompute-granularity full "
        "--recompute-method uniform in units of checkpoint_num_layers layers.",
    )
    checkpoint_num_layers: Int = Field(
        1, gt=0, description="Layers per unit with checkpoint_activations (Megatron-DeepSpeed's)."
    )
    compile: bool = Field(False, description="Wrap the model in torch.compile.")
    kernels: str | None = Field(
        None,
        description="Force CPU kernel choices instead of measuring them, e.g. "
        "'linear=torch,attention=sdpa,loss_chunk=4096' (wins over $ZEROTRON_KERNELS; "
        "zerotron.kernels.chooser).",
    )
    attention_backend: Literal["auto", "flash", "fused", "unfused", "local"] = Field(
        "auto",
        description="Megatron-LM's attention implementation: 'flash' is use_flash_attn; 'auto' "
        "lets the kernel chooser pick; Transformer Engine's 'fused', 'unfused' and 'local' have "
        "no counterpart (a warning).",
    )
    kv_channels: Int | None = Field(
        None, gt=0, description="Width of an attention head: hidden_size / num_attention_heads."
    )
    use_flash_attn: bool = Field(
        False,
        description="Attention by scaled_dot_product_attention's own kernels, its "
        "FlashAttention ones where the device has them (CUDA, the CPU): on the CPU the same as "
        "kernels 'attention=sdpa'; on CUDA SDPA is what runs anyway.",
    )
