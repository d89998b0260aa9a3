"""Data: tokenizers, preprocessing, Megatron .bin/.idx datasets, GPT datasets and samplers."""
