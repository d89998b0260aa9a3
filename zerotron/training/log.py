"""Megatron-LM's log lines, so a Megatron user's log parsers and eyes keep working.

Only formatting lives here; the loop decides what to log and when.
"""

from __future__ import annotations

import math
import os

import psutil
import torch

RULE = "-" * 100


def iteration_line(
    *,
    iteration: int,
    train_iters: int,
    consumed_samples: int,
    ms_per_iteration: float,
    learning_rate: float,
    global_batch_size: int,
    losses: dict[str, float],
    loss_scale: float,
    grad_norm: float | None,
    skipped_iterations: int,
    nan_iterations: int,
    tokens_per_second: float,
    tflops: float,
) -> str:
    s = f" iteration {iteration:8d}/{train_iters:8d} |"
    s += f" consumed samples: {consumed_samples:12d} |"
    s += f" elapsed time per iteration (ms): {ms_per_iteration:.1f} |"
    s += f" learning rate: {learning_rate:.3E} |"
    s += f" global batch size: {global_batch_size:5d} |"
    for name, value in losses.items():
        s += f" {name}: {value:.6E} |"
    s += f" loss scale: {loss_scale:.1f} |"
    if grad_norm is not None:
        s += f" grad norm: {grad_norm:.3f} |"
    s += f" number of skipped iterations: {skipped_iterations:3d} |"
    s += f" number of nan iterations: {nan_iterations:3d} |"
    s += f" tokens/s: {tokens_per_second:.0f} |"
    s += f" model TFLOP/s: {tflops:.2f} |"
    return s


def eval_line(prefix: str, losses: dict[str, float]) -> str:
    """`` validation loss at iteration 100 | lm loss value: 5.1E+00 | lm loss PPL: 1.6E+02 |``"""
    s = f" {prefix} |"
    for name, value in losses.items():
        s += f" {name} value: {value:.6E} |"
        s += f" {name} PPL: {perplexity(value):.6E} |"
    return s


def perplexity(loss: float) -> float:
    """exp(loss), the loss capped at 20 as Megatron-LM caps it (a diverged run stays finite)."""
    return math.exp(min(20.0, loss))


def memory_line(device: torch.device, after_iterations: int) -> str:
    """Megatron's memory report on CUDA; resident set size on CPU."""
    head = f" [after {after_iterations} iterations] memory (MB) |"
    if device.type == "cuda":
        mb = 1024 * 1024
        return (
            head
            + f" allocated: {torch.cuda.memory_allocated(device) / mb:.1f} |"
            + f" max allocated: {torch.cuda.max_memory_allocated(device) / mb:.1f} |"
            + f" reserved: {torch.cuda.memory_reserved(device) / mb:.1f} |"
            + f" max reserved: {torch.cuda.max_memory_reserved(device) / mb:.1f} |"
        )
    rss = psutil.Process(os.getpid()).memory_info().rss / (1024 * 1024)
    return head + f" rss: {rss:.1f} |"
