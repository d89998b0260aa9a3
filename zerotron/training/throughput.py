"""Model FLOPs and throughput: what the log's tokens/s and TFLOP/s, and the benchmarks' MFU, mean.

Model FLOPs per token for a GPT training step (forward + backward, no recompute counted):
``6·N + 12·L·h·s`` — 6 per parameter (2 forward, 4 backward multiply-adds) plus the attention
score and value products, which have no parameters (2·2·s·h per layer forward, ×3 with
backward). N counts the non-embedding matrices and the LM head (the tied embedding once).
"""

from __future__ import annotations


def model_flops_per_token(
    num_params: int, num_layers: int, hidden_size: int, seq_length: int
) -> float:
    return 6.0 * num_params + 12.0 * num_layers * hidden_size * seq_length


def tflops_per_second(flops_per_token: float, tokens: int, seconds: float) -> float:
    return flops_per_token * tokens / max(seconds, 1e-12) / 1e12
