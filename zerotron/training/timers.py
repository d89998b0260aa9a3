"""Named wall-clock timers, as Megatron's: start/stop around phases, report per interval.

On CUDA a timer synchronizes the device before reading the clock, so asynchronous kernels are
counted in the phase that launched them.
"""

from __future__ import annotations

import time

import torch


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
    """``timers("forward-backward").start()``; :meth:`log_line` formats the interval's times."""

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
