"""Learning-rate and weight-decay schedule with Megatron-LM's semantics.

:class:`OptimizerParamScheduler` (Megatron's name) sets ``lr`` (and optionally
``weight_decay``) on every optimizer param group after each ``step(increment)``. The LR:

- warmup: ``init_lr + (max_lr - init_lr) * n / warmup`` while ``n <= warmup`` (so ``lr == 0`` at
  ``n == 0`` with the default ``init_lr = 0``, and ``max_lr`` at ``n == warmup``);
- then from ``max_lr`` down to ``min_lr`` over ``decay - warmup`` steps: ``linear``
  (``1 - r``), ``cosine`` (``0.5 * (cos(pi * r) + 1)``), ``inverse-square-root``, or ``constant``
  (``max_lr`` for ever);
- ``min_lr`` after ``decay`` steps.

The unit of a "step" is the caller's: iterations (``step()`` once per iteration, warmup and
decay in iterations) or samples as Megatron counts them (``step(global_batch_size)``, warmup
and decay given in samples); the schedule is the same function of the fraction of decay done.

DeepSpeed's schedulers (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest) will
live beside this one with the same interface: ``step``, ``get_lr``, ``state_dict``,
``load_state_dict``.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from zerotron.errors import CheckpointError, ConfigError

DecayStyle = Literal["linear", "cosine", "constant", "inverse-square-root"]
WdIncrStyle = Literal["constant", "linear", "cosine"]
DECAY_STYLES = ("linear", "cosine", "constant", "inverse-square-root")
WD_INCR_STYLES = ("constant", "linear", "cosine")


class OptimizerParamScheduler:
    """Warmup then decay of the learning rate; optional weight-decay increment.

    Args:
        optimizer: anything with ``param_groups`` (a torch optimizer or
            ``MixedPrecisionOptimizer``). A group's own ``max_lr``/``min_lr`` override the
            scheduler's; its ``lr_mult``/``wd_mult`` scale the values set on it.
        max_lr: peak learning rate (``--lr``).
        min_lr: floor after decay (``--min-lr``).
        lr_decay_steps: step at which the decay ends (``--lr-decay-iters``, or samples).
        lr_decay_style: linear, cosine, constant or inverse-square-root.
        lr_warmup_steps: warmup length (``--lr-warmup-iters``).
        lr_warmup_fraction: warmup as a fraction of ``lr_decay_steps`` instead
            (``--lr-warmup-fraction``); give at most one of the two.
        init_lr: learning rate at step 0 of the warmup (``--lr-warmup-init``).
        start_wd, end_wd, wd_incr_steps, wd_incr_style: weight decay from ``start_wd`` to
            ``end_wd`` over ``wd_incr_steps``; None leaves groups' weight decay untouched.
        use_checkpoint_opt_param_scheduler: on load, take the schedule from the checkpoint.
        override_opt_param_scheduler: on load, keep this object's schedule (only the step
            count is restored). With neither (Megatron's default), a schedule value that
            differs from the checkpoint's is an error.
    """

    def __init__(
        self,
        optimizer: Any,
        *,
        max_lr: float,
        lr_decay_steps: int,
        min_lr: float = 0.0,
        lr_decay_style: DecayStyle = "linear",
        lr_warmup_steps: float = 0,
        lr_warmup_fraction: float | None = None,
        init_lr: float = 0.0,
        start_wd: float | None = None,
        end_wd: float | None = None,
        wd_incr_steps: int | None = None,
        wd_incr_style: WdIncrStyle = "constant",
        use_checkpoint_opt_param_scheduler: bool = False,
        override_opt_param_scheduler: bool = False,
    ):
        if lr_warmup_fraction is not None:
            if lr_warmup_steps:
                raise ConfigError(
                    f"both lr warmup steps ({lr_warmup_steps}) and warmup fraction "
                    f"({lr_warmup_fraction}) given",
                    where="--lr-warmup-fraction",
                    fix="give only one of --lr-warmup-iters and --lr-warmup-fraction",
                )
            # Megatron keeps the product as is (a float): the warmup ends at that point exactly.
            lr_warmup_steps = lr_warmup_fraction * lr_decay_steps
        if override_opt_param_scheduler and use_checkpoint_opt_param_scheduler:
            raise ConfigError(
                "both use-checkpoint and override given for the LR scheduler",
                where="--override-opt-param-scheduler",
                fix="give at most one of --use-checkpoint-opt-param-scheduler and "
                "--override-opt-param-scheduler",
            )
        self.optimizer = optimizer
        self.max_lr = float(max_lr)
        self.min_lr = float(min_lr)
        self.init_lr = float(init_lr)
        self.lr_warmup_steps = lr_warmup_steps
        self.lr_decay_steps = lr_decay_steps
        self.lr_decay_style = lr_decay_style
        if start_wd is not None and end_wd is None:
            end_wd = start_wd
        self.start_wd = start_wd
        self.end_wd = end_wd
        self.wd_incr_steps = wd_incr_steps
        self.wd_incr_style = wd_incr_style
        self.use_checkpoint_opt_param_scheduler = use_checkpoint_opt_param_scheduler
        self.override_opt_param_scheduler = override_opt_param_scheduler
        self.num_steps = 0
        self._validate()
        self.step(0)

    def _validate(self) -> None:
        def bad(what: str, key: str, fix: str) -> ConfigError:
            return ConfigError(what, where=key, fix=fix)

        if not 0.0 <= self.min_lr <= self.max_lr:
            raise bad(
                f"need 0 <= min_lr <= max_lr, got min_lr={self.min_lr}, max_lr={self.max_lr}",
                "--min-lr",
                "set --min-lr between 0 and --lr",
            )
        if self.lr_decay_style not in DECAY_STYLES:
            raise bad(
                f"lr decay style {self.lr_decay_style!r} is not one of {', '.join(DECAY_STYLES)}",
                "--lr-decay-style",
                f"use one of {', '.join(DECAY_STYLES)}",
            )
        # A constant schedule never decays, so its decay length may be 0 (the config allows it).
        decays = self.lr_decay_style != "constant"
        if decays and self.lr_decay_steps <= 0:
            raise bad(
                f"lr decay steps must be > 0, got {self.lr_decay_steps}",
                "--lr-decay-iters",
                "set --lr-decay-iters (default: --train-iters) to a positive number",
            )
        if self.lr_warmup_steps < 0 or (decays and self.lr_warmup_steps >= self.lr_decay_steps):
            raise bad(
                f"lr warmup ({self.lr_warmup_steps}) must be >= 0 and shorter than the decay "
                f"({self.lr_decay_steps})",
                "--lr-warmup-iters",
                "shorten the warmup or lengthen --lr-decay-iters",
            )
        if self.wd_incr_style not in WD_INCR_STYLES:
            raise bad(
                f"weight decay increment style {self.wd_incr_style!r} is not one of "
                f"{', '.join(WD_INCR_STYLES)}",
                "--weight-decay-incr-style",
                f"use one of {', '.join(WD_INCR_STYLES)}",
            )
        if self.start_wd is not None:
            if self.start_wd < 0 or self.end_wd < self.start_wd:
                raise bad(
                    f"need 0 <= start_wd <= end_wd, got {self.start_wd}, {self.end_wd}",
                    "--start-weight-decay",
                    "check --start-weight-decay and --end-weight-decay",
                )
            if self.wd_incr_style == "constant" and self.start_wd != self.end_wd:
                raise bad(
                    "constant weight decay needs start_wd == end_wd",
                    "--weight-decay-incr-style",
                    "use linear or cosine to change weight decay over training",
                )
            if self.wd_incr_style != "constant" and not (self.wd_incr_steps or 0) > 0:
                raise bad(
                    "a weight decay increment needs wd_incr_steps > 0",
                    "--weight-decay-incr-style",
                    "give the number of steps (Megatron: the training length)",
                )

    def get_lr(self, param_group: dict[str, Any] | None = None) -> float:
        """The learning rate at the current step (for ``param_group``'s ``max_lr``/``min_lr``
        when it sets them)."""
        group = param_group or {}
        max_lr = group.get("max_lr", self.max_lr)
        min_lr = group.get("min_lr", self.min_lr)
        n = self.num_steps
        if self.lr_warmup_steps > 0 and n <= self.lr_warmup_steps:
            return self.init_lr + (max_lr - self.init_lr) * float(n) / float(self.lr_warmup_steps)
        if self.lr_decay_style == "constant":
            return max_lr
        if n > self.lr_decay_steps:
            return min_lr
        if self.lr_decay_style == "inverse-square-root":
            warmup = max(self.lr_warmup_steps, 1)
            return max(min_lr, max_lr * math.sqrt(warmup) / math.sqrt(max(n, 1)))
        ratio = float(n - self.lr_warmup_steps) / float(self.lr_decay_steps - self.lr_warmup_steps)
        if self.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        else:  # cosine
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return min_lr + coeff * (max_lr - min_lr)

    def get_wd(self) -> float | None:
        """The weight decay at the current step, or None when not scheduled."""
        if self.start_wd is None:
            return None
        if self.wd_incr_style == "constant" or self.num_steps > (self.wd_incr_steps or 0):
            return self.end_wd
        ratio = float(self.num_steps) / float(self.wd_incr_steps)
        if self.wd_incr_style == "linear":
            coeff = ratio
        else:  # cosine: rises from 0 to 1
            coeff = 0.5 * (math.cos(math.pi * (1.0 - ratio)) + 1.0)
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    def step(self, increment: int = 1) -> None:
        """Advance by ``increment`` steps and set every group's ``lr`` (and weight decay)."""
        self.num_steps += increment
        new_wd = self.get_wd()
        for group in self.optimizer.param_groups:
            group["lr"] = self.get_lr(group) * group.get("lr_mult", 1.0)
            if new_wd is not None:
                group["weight_decay"] = new_wd * group.get("wd_mult", 1.0)

    def state_dict(self) -> dict[str, Any]:
        """Megatron's keys (so either tool can read the other's scheduler state)."""
        return {
            "max_lr": self.max_lr,
            "lr_warmup_steps": self.lr_warmup_steps,
            "num_steps": self.num_steps,
            "lr_decay_style": self.lr_decay_style,
            "lr_decay_steps": self.lr_decay_steps,
            "min_lr": self.min_lr,
            "start_wd": self.start_wd,
            "end_wd": self.end_wd,
            "wd_incr_style": self.wd_incr_style,
            "wd_incr_steps": self.wd_incr_steps,
            "init_lr": self.init_lr,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the step count, and the schedule per the ``use_checkpoint`` /
        ``override`` switches; then set the optimizer's lr for the restored step."""
        # Older Megatron checkpoints used other names for the same values.
        aliases = {
            "max_lr": ("start_lr",),
            "lr_warmup_steps": ("warmup_steps", "warmup_iter"),
            "lr_decay_steps": ("decay_steps", "end_iter"),
            "lr_decay_style": ("decay_style",),
            "num_steps": ("num_iters",),
        }

        def saved(key: str) -> Any:
            for k in (key, *aliases.get(key, ())):
                if k in state:
                    return state[k]
            return _MISSING

        for key in ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style"):
            setattr(self, key, self._check_and_set(getattr(self, key), saved(key), key))
        for key in ("init_lr", "start_wd", "end_wd", "wd_incr_style", "wd_incr_steps"):
            value = saved(key)
            if value is not _MISSING:
                setattr(self, key, self._check_and_set(getattr(self, key), value, key))
        num_steps = saved("num_steps")
        if num_steps is _MISSING:
            raise CheckpointError(
                "scheduler state has no step count (num_steps)",
                where="opt_param_scheduler",
                fix="the checkpoint's scheduler state is incomplete; use --override-opt-param-"
                "scheduler with --no-load-optim to start the schedule afresh",
            )
        self.num_steps = 0
        self.step(increment=num_steps)

    def _check_and_set(self, ours: Any, theirs: Any, name: str) -> Any:
        if theirs is _MISSING or self.override_opt_param_scheduler:
            return ours
        if not self.use_checkpoint_opt_param_scheduler and ours != theirs:
            raise ConfigError(
                f"scheduler {name} is {ours} here but {theirs} in the checkpoint",
                where=f"opt_param_scheduler.{name}",
                fix="pass --use-checkpoint-opt-param-scheduler to take the checkpoint's value or "
                "--override-opt-param-scheduler to keep this run's",
            )
        return theirs


_MISSING = object()
