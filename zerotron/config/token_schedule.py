"""Megatron-DeepSpeed's token-based lengths: ``--train-tokens``, ``--lr-decay-tokens``,
``--lr-warmup-tokens``.

Megatron-DeepSpeed counts tokens beside samples so that curriculum learning, which shortens the
sequences, still ends the schedule at the same point. zerotron has no curriculum: every sample
is ``seq_length`` tokens, so a length in tokens is the length in samples times ``seq_length``,
and the scheduler (which counts samples) takes ``tokens / seq_length`` samples, fractions kept:

* the warmup ends, and the decay runs, exactly where Megatron-DeepSpeed's ``num_tokens``
  reaches them (its ratios ``num_tokens / lr_warmup_tokens`` are zerotron's ``samples /
  (lr_warmup_tokens / seq_length)``, the same value up to rounding);
* ``--train-tokens`` stops training before the first step that would start with that many
  tokens consumed, as Megatron-DeepSpeed's loop checks it, if that comes before the end of
  ``--train-iters`` / ``--train-samples``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from zerotron.errors import ConfigError

if TYPE_CHECKING:
    from zerotron.config.schema import Config


def check_tokens(cfg: Config) -> None:
    """Refuse a length given both in tokens and otherwise, and a token warmup without a token
    decay (Megatron-DeepSpeed then decays from step 0, not from the warmup's end)."""
    s, given = cfg.scheduler, cfg._inputs["scheduler"]
    if s.lr_decay_tokens is not None:
        for name in ("lr_decay_iters", "lr_decay_samples"):
            if given[name] is not None:
                raise _both("lr_decay_tokens", name)
    if s.lr_warmup_tokens is not None:
        if s.lr_decay_tokens is None:
            raise ConfigError(
                "lr_warmup_tokens is set without lr_decay_tokens",
                where="scheduler.lr_warmup_tokens",
                fix="give the decay in tokens too (--lr-decay-tokens), or the warmup in "
                "iterations or samples",
            )
        for name, default in (
            ("lr_warmup_iters", 0),
            ("lr_warmup_samples", 0),
            ("lr_warmup_fraction", None),
        ):
            if given[name] != default:
                raise _both("lr_warmup_tokens", name)


def _both(tokens: str, other: str) -> ConfigError:
    return ConfigError(
        f"{tokens} and {other} are both set",
        where=f"scheduler.{tokens}",
        fix=f"give the length once: --{tokens.replace('_', '-')} or --{other.replace('_', '-')}",
    )


def token_steps(cfg: Config) -> int | None:
    """The steps before ``train_tokens`` are consumed (None without train_tokens)."""
    t, seq = cfg.training, cfg.model.seq_length
    if t.train_tokens is None or seq is None:
        return None
    samples = math.ceil(t.train_tokens / seq)
    ramp = cfg.batch_ramp
    if ramp is not None:
        return ramp.iterations_for(samples)
    return math.ceil(samples / t.global_batch_size)


def limit_by_tokens(cfg: Config, fill: Callable[..., None]) -> None:
    """``train_iters`` cut to :func:`token_steps`."""
    steps, t = token_steps(cfg), cfg.training
    if steps is not None and t.train_iters is not None and steps < t.train_iters:
        fill(t, train_iters=steps)


def in_samples(tokens: int | None, cfg: Any) -> float | None:
    """A length in tokens as the scheduler's samples (None stays None)."""
    return None if tokens is None else tokens / cfg.model.seq_length
