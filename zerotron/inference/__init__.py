"""Text generation from a trained model: sampling and the decoding loop with a KV cache."""

from zerotron.inference.generate import (
    generate,
    generate_batch,
    sample_logits,
    top_k_filter,
    top_p_filter,
)

__all__ = ["generate", "generate_batch", "sample_logits", "top_k_filter", "top_p_filter"]
