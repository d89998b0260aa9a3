"""Named wall-clock timers: start/stop around phases, read per interval.

One implementation serves both users: Megatron's training-loop timers (``forward-backward``,
``optimizer``, ``batch-generator``; :meth:`Timers.log_line` formats an interval's times) and
DeepSpeed's ``wall_clock_breakdown`` (the Engine times ``forward``, ``backward``,
``backward_allreduce`` and ``step``, :data:`WALL_CLOCK_TIMERS`).

On CUDA a timer synchronizes the device before reading the clock, so asynchronous kernels are
counted in the phase that launched them.
"""

from __future__ import annotations

import time

import torch

# DeepSpeed's wall_clock_breakdown timers, printed every steps_per_print steps
WALL_CLOCK_TIMERS = ("forward", "backward", "backward_allreduce", "step")


class Timer:
    def __init__(self, name: str):
        self.name = name
        self.elapsed_ = 0.0
        self.started_: float | None = None

    def start(self) -> None:
        assert self.started_ is None, f"timer {self.name} already started"
        _sync()
        self.started_ = time.perf_counter()

    def stop(self) -> None:
        assert self.started_ is not None, f"timer {self.name} is not started"
        _sync()
        self.elapsed_ += time.perf_counter() - self.started_
        self.started_ = None

    def elapsed(self, reset: bool = True) -> float:
        """Seconds accumulated since the last reset (a running timer counts up to now)."""
        running = self.started_ is not None
        if running:
            self.stop()
        value = self.elapsed_
        if reset:
            self.elapsed_ = 0.0
        if running:
            self.start()
        return value


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class Timers:
    """``timers("forward-backward").start()``: a timer created on first use."""

    def __init__(self) -> None:
        self._timers: dict[str, Timer] = {}

    def __call__(self, name: str) -> Timer:
        if name not in self._timers:
            self._timers[name] = Timer(name)
        return self._timers[name]

    def log_line(self, names: list[str], normalizer: float = 1.0, reset: bool = True) -> str:
        """`` time (ms) | forward-backward: 812.34 | optimizer: 40.12`` averaged per iteration."""
        parts = [
            f"{n}: {self._timers[n].elapsed(reset) * 1000.0 / normalizer:.2f}"
            for n in names
            if n in self._timers
        ]
        return " time (ms) | " + " | ".join(parts) if parts else ""


def wall_clock_line(times_ms: dict[str, float], step: int) -> str:
    """``[step 10] time (ms) | forward: 12.30 | backward: ...`` (wall_clock_breakdown)."""
    parts = " | ".join(f"{name}: {ms:.2f}" for name, ms in times_ms.items())
    return f"[step {step}] time (ms) | {parts}"


class NullTimer:
    """A timer that measures nothing (the Engine's default when nothing is timed)."""

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def elapsed(self, reset: bool = True) -> float:
        return 0.0


class NullTimers:
    """``timers(name)`` -> a :class:`NullTimer`."""

    _timer = NullTimer()

    def __call__(self, name: str) -> NullTimer:
        return self._timer


class ThroughputTimer:
    """DeepSpeed's ``engine.tput_timer``: samples per second over the optimizer steps.

    :meth:`start` marks the start of a micro-batch (the Engine calls it at each forward, the
    pipeline at each ``train_batch``) and :meth:`stop` its end (at each ``step()`` call;
    ``global_step`` when that call stepped the optimizer). Time counts from step
    ``start_step`` on (the first steps warm up), so :meth:`avg_samples_per_sec` is
    ``batch_size`` over the mean time of an optimizer step since then, ``-inf`` before any.
    """

    def __init__(self, batch_size: int, start_step: int = 2, steps_per_output: int | None = None):
        self.batch_size = 1 if batch_size is None else batch_size
        self.start_step = start_step
        self.steps_per_output = steps_per_output
        self.epoch_count = 0
        self.micro_step_count = 0
        self.global_step_count = 0
        self.total_elapsed_time = 0.0
        self.step_elapsed_time = 0.0
        self.start_time = 0.0
        self.started = False

    def update_epoch_count(self) -> None:
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        if self.started:  # a second forward before step(): the micro-batch began earlier
            return
        self.started = True
        if self.global_step_count >= self.start_step:
            _sync()
            self.start_time = time.time()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        if not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        if self.start_time > 0:
            _sync()
            duration = time.time() - self.start_time
            self.total_elapsed_time += duration
            self.step_elapsed_time += duration
            if global_step:
                self.step_elapsed_time = 0.0

    def avg_samples_per_sec(self) -> float:
        """``batch_size`` over the mean seconds per optimizer step since ``start_step``."""
        steps = self.global_step_count - self.start_step
        if self.global_step_count > 0 and steps > 0 and self.total_elapsed_time > 0:
            return self.batch_size / (self.total_elapsed_time / steps)
        return float("-inf")
