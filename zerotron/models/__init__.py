"""Models written against the parallel layers (GPT-2 so far)."""

from zerotron.models.gpt import GPT, VOCAB_PADDED_KEYS, GPTConfig, KVCache, print_num_parameters

__all__ = ["GPT", "GPTConfig", "KVCache", "VOCAB_PADDED_KEYS", "print_num_parameters"]
