"""Batch-size ramp-up: the global batch size as a function of the samples trained on so far.

Megatron-LM has two ways to say it, both resolved here into steps ``(first sample, size)``:

- ``--rampup-batch-size START INCREMENT SAMPLES`` (Megatron-LM until 2026, Megatron-DeepSpeed):
  the batch starts at START and grows by INCREMENT each time another
  ``SAMPLES / ((GLOBAL - START) / INCREMENT)`` samples are consumed, up to
  ``--global-batch-size``: after ``c`` samples the size is ``START + INCREMENT ·
  floor(c · n / SAMPLES)`` with ``n`` increments, as Megatron's calculator computes it.
- ``--step-batch-size-schedule "THRESHOLD:SIZE ..."`` (Megatron-LM now): SIZE from THRESHOLD
  tokens on (``seq_length`` tokens a sample, rounded down), the first THRESHOLD 0; numbers may
  end in K, M, B or T (10^3 ... 10^12), e.g. ``"0:16 2.4B:320 4.8B:624"``.

The last size is the run's ``global_batch_size`` (the one its learning-rate schedule converts
iterations with, as Megatron's); each size must split into whole micro-batches on every
data-parallel rank, which the config checks.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

from zerotron.errors import ConfigError

_SUFFIX = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


@dataclass(frozen=True)
class BatchRamp:
    """Global batch size by samples consumed: ``steps`` of ``(first sample, size)``, the first
    sample of the first 0, ascending."""

    steps: tuple[tuple[int, int], ...]

    @property
    def sizes(self) -> list[int]:
        return [size for _, size in self.steps]

    @property
    def final(self) -> int:
        return self.steps[-1][1]

    def size_at(self, consumed: int) -> int:
        """The global batch size of the step that starts after ``consumed`` samples."""
        return self.steps[bisect_right([first for first, _ in self.steps], consumed) - 1][1]

    def iterations_for(self, samples: int) -> int:
        """Steps until at least ``samples`` are consumed (Megatron's count for
        ``--train-samples``)."""
        return self._walk(samples=samples)[0]

    def samples_after(self, iterations: int) -> int:
        """Samples consumed by the first ``iterations`` steps."""
        return self._walk(iterations=iterations)[1]

    def _walk(self, samples: int | None = None, iterations: int | None = None) -> tuple[int, int]:
        """``(steps, samples consumed)`` when ``samples`` are reached or ``iterations`` are done,
        a stretch of one size at a time (a step's size is the one at the samples before it)."""
        steps = consumed = 0
        ends = [first for first, _ in self.steps[1:]] + [None]
        for (_, size), end in zip(self.steps, ends):
            if samples is not None:
                end = samples if end is None else min(end, samples)
            if end is not None and consumed >= end:
                continue  # overshot into a later stretch (or done)
            n = -(-(end - consumed) // size) if end is not None else iterations - steps
            if iterations is not None:
                n = min(n, iterations - steps)
            steps, consumed = steps + n, consumed + n * size
        return steps, consumed


def linear_ramp(values: Sequence[int], final: int) -> BatchRamp:
    """``--rampup-batch-size START INCREMENT SAMPLES`` (``values``) up to ``final``."""
    where = "training.rampup_batch_size"
    if len(values) != 3:
        raise ConfigError(
            f"rampup_batch_size takes 3 numbers (START INCREMENT SAMPLES), got {len(values)}",
            where=where,
            fix="e.g. --rampup-batch-size 32 32 1000000",
        )
    start, increment, samples = (int(v) for v in values)
    if min(start, increment, samples) < 1:
        raise ConfigError(
            f"rampup_batch_size {start} {increment} {samples}: every number must be positive",
            where=where,
            fix="give START INCREMENT SAMPLES, e.g. --rampup-batch-size 32 32 1000000",
        )
    if start > final or (final - start) % increment:
        raise ConfigError(
            f"rampup_batch_size starts at {start} and grows by {increment}, which does not "
            f"reach global_batch_size {final}",
            where=where,
            fix=f"choose START <= {final} with {final} - START a multiple of INCREMENT",
        )
    n = (final - start) // increment
    if n == 0:
        return BatchRamp(((0, final),))
    # the first c with floor(c * n / samples) >= k, for each increment k
    return BatchRamp(tuple((-(-k * samples // n), start + k * increment) for k in range(n + 1)))


def step_schedule(text: str, seq_length: int) -> BatchRamp:
    """``--step-batch-size-schedule`` (thresholds in tokens) as steps in samples."""
    where = "training.step_batch_size_schedule"
    steps: list[tuple[int, int]] = []
    for entry in text.replace(",", " ").split():
        threshold, sep, size = entry.partition(":")
        if not sep:
            raise ConfigError(
                f"{entry!r} is not THRESHOLD:SIZE",
                where=where,
                fix='e.g. "0:16 2.4B:320" (tokens:global batch size)',
            )
        first, value = _number(threshold, where) // seq_length, _number(size, where)
        if value < 1:
            raise ConfigError(f"{entry!r}: the batch size must be positive", where=where)
        steps.append((first, value))
    steps.sort()
    if not steps or steps[0][0] != 0:
        raise ConfigError(
            f"{text!r} does not start at 0 tokens",
            where=where,
            fix='give the first size from 0, e.g. "0:16 ..."',
        )
    firsts = [first for first, _ in steps]
    if len(set(firsts)) != len(firsts):
        raise ConfigError(
            f"{text!r} has two sizes from the same sample (thresholds are tokens, "
            f"{seq_length} a sample)",
            where=where,
            fix="make the thresholds at least one sample apart",
        )
    return BatchRamp(tuple(steps))


def _number(text: str, where: str) -> int:
    text = text.strip().upper()
    scale = _SUFFIX.get(text[-1:], 1)
    try:
        return int(float(text[:-1] if scale > 1 else text) * scale)
    except ValueError:
        raise ConfigError(
            f"{text!r} is not a number (suffixes K, M, B, T allowed)", where=where
        ) from None


def check_divisible(ramp: BatchRamp, unit: int, what: str, pp_for_interleaving: int) -> None:
    """Every size of ``ramp`` is a whole number of ``unit`` (micro-batch × data-parallel)
    micro-batch rows, and with interleaving a multiple of ``pp_for_interleaving`` of them."""
    for size in ramp.sizes:
        if size % unit:
            raise ConfigError(
                f"the batch-size ramp reaches {size}, not a multiple of {what} = {unit}",
                where="training.global_batch_size",
                fix=f"ramp through multiples of {unit}",
            )
        if pp_for_interleaving > 1 and (size // unit) % pp_for_interleaving:
            raise ConfigError(
                f"the batch-size ramp reaches {size}: {size // unit} micro-batches, not a "
                f"multiple of pipeline_model_parallel_size {pp_for_interleaving} (interleaved)",
                where="training.global_batch_size",
                fix=f"ramp through multiples of {unit * pp_for_interleaving}",
            )
