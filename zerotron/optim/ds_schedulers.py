"""DeepSpeed's learning-rate schedules: WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle,
LRRangeTest, with DeepSpeed's formulas and its timing.

Timing (as DeepSpeed's ``deepspeed/runtime/lr_schedules.py``): a schedule counts
``last_batch_iteration``, -1 at construction, and each ``step()`` advances it and sets the
learning rate for the *next* optimizer step. Construction sets the rate of the first step
(``warmup_min_lr`` for the warmups, 0 for WarmupCosineLR, ``cycle_min_lr``,
``lr_range_test_min_lr``). So the optimizer's step k (k = 0, 1, ...) runs at ``f(k - 1)``.

With ``n`` = last_batch_iteration and ``W`` = max(2, warmup_num_steps):

- WarmupLR: ``min + (max - min) · γ``, γ = ``log(n + 1) / log(W)`` (log warmup) or ``n / W``
  (linear) while ``n < W``, then 1.
- WarmupDecayLR: the same warmup, then γ = ``max(0, (T - n) / max(1, T - W))``,
  T = total_num_steps.
- WarmupCosineLR: ratio of the optimizer's initial lr: warmup ``r0 + (1 - r0) · γ``
  (r0 = warmup_min_ratio), then ``c + (1 - c) · (1 + cos(π · min(1, (n - W + 1) /
  max(1, T - W)))) / 2``, c = cos_min_ratio.
- OneCycle: over a cycle of ``s1 + s2`` iterations (first and second step sizes), x =
  fraction of the cycle at ``n + 1``; lr rises linearly from cycle_min_lr to cycle_max_lr for
  the first ``s1`` and falls back for ``s2`` (optionally in stairs); momentum (Adam's beta1)
  moves the opposite way between cycle_max_mom and cycle_min_mom (beta2 is kept; DeepSpeed
  resets it to 0.99). After the cycle:
  ``cycle_min_lr / (1 + decay_lr_rate · (n - s1 - s2 + 1) / decay_step_size)``.
- LRRangeTest: ``min_lr · (1 + step_rate · (n + 1) / step_size)`` (the quotient floored with
  staircase).

All share the interface of :class:`~zerotron.optim.lr_schedule.OptimizerParamScheduler`:
``step(increment=1)``, ``get_lr()``, ``state_dict()``, ``load_state_dict(state)``; the
optimizer is anything with ``param_groups``.
"""

from __future__ import annotations

import math
from typing import Any

from zerotron.errors import ConfigError


class _Schedule:
    """Common state: the optimizer's groups and ``last_batch_iteration``."""

    def __init__(self, optimizer: Any):
        self.optimizer = optimizer
        self.last_batch_iteration = -1

    def lr_at(self, n: int) -> list[float]:
        """The learning rate of every group once ``last_batch_iteration`` is ``n``."""
        raise NotImplementedError

    def get_lr(self) -> list[float]:
        return self.lr_at(self.last_batch_iteration)

    def get_last_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def _apply(self) -> None:
        for group, lr in zip(self.optimizer.param_groups, self.get_lr()):
            group["lr"] = lr

    def step(self, increment: int = 1) -> None:
        """Advance by ``increment`` iterations and set the learning rate."""
        self.last_batch_iteration += increment
        self._apply()

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_batch_iteration = int(state["last_batch_iteration"])
        self._apply()

    def _per_group(self, value: float | list | tuple, name: str) -> list[float]:
        groups = len(self.optimizer.param_groups)
        if isinstance(value, (list, tuple)):
            if len(value) != groups:
                raise ConfigError(
                    f"{name} has {len(value)} values for {groups} parameter groups",
                    where=f"scheduler.params.{name}",
                    fix="give one value, or one per parameter group",
                )
            return [float(v) for v in value]
        return [float(value)] * groups


def _warmup_gamma(n: int, warmup: int, kind: str) -> float:
    if kind == "log":
        return math.log(n + 1) / math.log(warmup)
    return n / warmup


def _check_warmup_type(kind: str) -> str:
    if kind not in ("log", "linear"):
        raise ConfigError(
            f"warmup_type {kind!r} is not one of log, linear", where="scheduler.params.warmup_type"
        )
    return kind


class WarmupLR(_Schedule):
    """From ``warmup_min_lr`` to ``warmup_max_lr`` (default: the optimizer's lr) over
    ``warmup_num_steps``, then constant."""

    def __init__(
        self,
        optimizer: Any,
        warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
    ):
        super().__init__(optimizer)
        if warmup_max_lr is None:
            warmup_max_lr = optimizer.param_groups[0]["lr"]
        self.min_lrs = self._per_group(warmup_min_lr, "warmup_min_lr")
        self.max_lrs = self._per_group(warmup_max_lr, "warmup_max_lr")
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        self.warmup_type = _check_warmup_type(warmup_type)
        self._apply()

    def gamma(self, n: int) -> float:
        if n < self.warmup_num_steps:
            return _warmup_gamma(n, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def lr_at(self, n: int) -> list[float]:
        if n < 0:
            return list(self.min_lrs)
        g = self.gamma(n)
        return [lo + (hi - lo) * g for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at ``total_num_steps``."""

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
    ):
        self.total_num_steps = int(total_num_steps)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type)

    def gamma(self, n: int) -> float:
        if n < self.warmup_num_steps:
            return _warmup_gamma(n, self.warmup_num_steps, self.warmup_type)
        remaining = max(1.0, self.total_num_steps - self.warmup_num_steps)
        return max(0.0, (self.total_num_steps - n) / remaining)


class WarmupCosineLR(_Schedule):
    """A ratio of each group's initial lr: warmup from ``warmup_min_ratio`` to 1, then cosine
    decay to ``cos_min_ratio`` at ``total_num_steps``."""

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
    ):
        super().__init__(optimizer)
        self.total_num_steps = int(total_num_steps)
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        self.cos_min_ratio = float(cos_min_ratio)
        self.warmup_type = _check_warmup_type(warmup_type)
        self.org_lrs = [g["lr"] for g in optimizer.param_groups]
        self._apply()

    def ratio(self, n: int) -> float:
        if n < 0:
            return 0.0
        w = self.warmup_num_steps
        if n < w:
            g = _warmup_gamma(n, w, self.warmup_type)
            return self.warmup_min_ratio + g * (1.0 - self.warmup_min_ratio)
        progress = min(1.0, (n - w + 1) / max(1, self.total_num_steps - w))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def lr_at(self, n: int) -> list[float]:
        r = self.ratio(n)
        return [lr * r for lr in self.org_lrs]

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "org_lrs": list(self.org_lrs)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.org_lrs = list(state.get("org_lrs", self.org_lrs))
        super().load_state_dict(state)


class OneCycle(_Schedule):
    """1Cycle: lr up from ``cycle_min_lr`` to ``cycle_max_lr`` and back down, momentum the other
    way, then optional decay (see the module docstring)."""

    def __init__(
        self,
        optimizer: Any,
        cycle_min_lr: float,
        cycle_max_lr: float,
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float = 0.8,
        cycle_max_mom: float = 0.9,
        decay_mom_rate: float = 0.0,
    ):
        super().__init__(optimizer)
        first = float(cycle_first_step_size)
        second = float(cycle_second_step_size) if cycle_second_step_size is not None else first
        self.first_step_size, self.second_step_size = first, second
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = cycle_first_stair_count
        second_stairs = cycle_second_stair_count
        if second_stairs is None:
            second_stairs = cycle_first_stair_count
        self.second_stair_count = second_stairs
        self.decay_step_size = decay_step_size
        self.min_lrs = self._per_group(cycle_min_lr, "cycle_min_lr")
        self.max_lrs = self._per_group(cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = decay_lr_rate
        self.skip_lr_decay = decay_step_size == 0 or decay_lr_rate == 0
        # DeepSpeed cycles Adam's beta1; an optimizer without betas keeps its momentum.
        self.cycle_momentum = cycle_momentum and "betas" in optimizer.param_groups[0]
        self.min_mom, self.max_mom = cycle_min_mom, cycle_max_mom
        self.decay_mom_rate = decay_mom_rate
        self.skip_mom_decay = decay_step_size == 0 or decay_mom_rate == 0
        self._apply()

    def scale_factor(self, n: int) -> float:
        it = n + 1
        cycle = math.floor(1 + it / self.total_size)
        x = 1.0 + it / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs and stairs > 0:
            pos = it % self.total_size
            if pos <= self.first_step_size:
                stair = pos * stairs / self.first_step_size
            else:
                stair = (self.total_size - pos) * stairs / self.second_step_size
            scale = math.floor(stair) / stairs
        return scale

    def lr_at(self, n: int) -> list[float]:
        if n < 0:
            return list(self.min_lrs)
        if n < self.total_size:
            s = self.scale_factor(n)
            return [lo + (hi - lo) * s for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        interval = (n - self.total_size + 1) / self.decay_step_size
        return [lo / (1 + self.decay_lr_rate * interval) for lo in self.min_lrs]

    def mom_at(self, n: int) -> float:
        if n < 0:
            return self.min_mom
        if n < self.total_size:
            return self.max_mom - (self.max_mom - self.min_mom) * self.scale_factor(n)
        if self.skip_mom_decay:
            return self.max_mom
        interval = (n - self.total_size + 1) / self.decay_step_size
        return self.max_mom * (1 + self.decay_mom_rate * interval)

    def _apply(self) -> None:
        super()._apply()
        if self.cycle_momentum:
            mom = self.mom_at(self.last_batch_iteration)
            for group in self.optimizer.param_groups:
                group["betas"] = (mom, group["betas"][1])


class LRRangeTest(_Schedule):
    """Learning-rate range test: the lr grows linearly (or in stairs) from its minimum."""

    def __init__(
        self,
        optimizer: Any,
        lr_range_test_min_lr: float | list[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
    ):
        super().__init__(optimizer)
        self.min_lrs = self._per_group(lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        self._apply()

    def lr_at(self, n: int) -> list[float]:
        interval = (n + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [lr * (1 + self.step_rate * interval) for lr in self.min_lrs]


DS_SCHEDULERS: dict[str, type[_Schedule]] = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
    "OneCycle": OneCycle,
    "LRRangeTest": LRRangeTest,
}


def build_ds_scheduler(name: str, optimizer: Any, params: dict[str, Any]) -> _Schedule:
    """DeepSpeed's scheduler ``name`` over ``optimizer`` with its JSON ``params``."""
    if name not in DS_SCHEDULERS:
        raise ConfigError(
            f"unknown scheduler {name!r}",
            where="scheduler.type",
            fix=f"use one of {', '.join(DS_SCHEDULERS)}",
        )
    kwargs = {k: v for k, v in params.items() if k != "last_batch_iteration"}
    return DS_SCHEDULERS[name](optimizer, **kwargs)
