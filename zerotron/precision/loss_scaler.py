"""Loss scaling for fp16 training: a static scale, or a dynamic one with DeepSpeed's semantics.

fp16 gradients underflow to zero when small; multiplying the loss by a large scale before
backward lifts them into range, and the optimizer divides it out again before stepping. Too large
a scale overflows instead, so the dynamic scaler searches for the largest one that works:

- an overflowing step is skipped and, once ``hysteresis`` overflows have been seen, the scale is
  divided by ``scale_factor`` (never below ``min_scale``);
- after ``scale_window`` steps without overflow the scale is multiplied by ``scale_factor`` and
  the hysteresis budget is refilled;
- with ``consecutive_hysteresis`` the budget is refilled after every step without overflow, so
  only *consecutive* overflows can lower the scale.

These are DeepSpeed's rules (``DynamicLossScaler.update_scale``), including two details worth
knowing: once the hysteresis budget is spent, every further overflow halves the scale until the
budget is refilled, and the first doubling after an overflow at step ``k`` happens at step
``k + scale_window + 1``. bf16 and fp32 need no scaling; the optimizer then has no scaler.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from zerotron.errors import CheckpointError, ConfigError, ZerotronError

logger = logging.getLogger(__name__)


class LossScaler:
    """Interface of a loss scaler; the base class is a static scale of 1 (no scaling)."""

    dynamic = False

    def __init__(self, scale: float = 1.0):
        if not scale > 0 or scale == float("inf"):
            raise ConfigError(
                f"loss scale must be a positive finite number, got {scale!r}",
                where="loss_scale",
                fix="pass a positive loss scale, or 0/None for dynamic loss scaling",
            )
        self.cur_scale = float(scale)

    @property
    def loss_scale(self) -> float:
        """The scale the next backward should use (DeepSpeed's name)."""
        return self.cur_scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * loss_scale``: call ``.backward()`` on the result."""
        return loss * self.cur_scale

    def update(self, overflow: bool) -> None:
        """Record the outcome of one optimizer step (static scalers ignore it)."""

    def state_dict(self) -> dict[str, Any]:
        return {"dynamic": False, "cur_scale": self.cur_scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # A static scale comes from the configuration of this run, as in Megatron's
        # ConstantGradScaler: nothing in a checkpoint overrides it.
        del state


class ScalesLoss:
    """What an optimizer wrapper owning an optional ``loss_scaler`` gives the Engine: the current
    scale (1.0 without fp16 scaling) under its and DeepSpeed's names, and the loss to backward.

    Shared by :class:`~zerotron.precision.mixed.MixedPrecisionOptimizer` and ZeRO's optimizer.
    """

    loss_scaler: LossScaler | None

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.loss_scale if self.loss_scaler is not None else 1.0

    @property
    def cur_scale(self) -> float:  # DeepSpeed's name
        return self.loss_scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call ``.backward()`` on: multiplied by the loss scale under fp16."""
        return self.loss_scaler.scale(loss) if self.loss_scaler is not None else loss


class StaticLossScaler(LossScaler):
    """A constant loss scale (Megatron's ``--loss-scale``, DeepSpeed's ``fp16.loss_scale > 0``)."""


class DynamicLossScaler(LossScaler):
    """Dynamic loss scaling with DeepSpeed's update rule (see the module docstring).

    Args:
        init_scale: first scale tried; default ``2**32`` (Megatron's ``--initial-loss-scale``).
        initial_scale_power: DeepSpeed's way to give the first scale, ``2**initial_scale_power``
            (DeepSpeed's default is 16). Give at most one of the two.
        scale_factor: what the scale is divided by on overflow and multiplied by after a window.
        scale_window: steps without overflow before the scale grows.
        min_scale: the scale never goes below this.
        hysteresis: overflows tolerated before the scale is lowered (DeepSpeed's
            ``delayed_shift``); 1 lowers it on every overflow.
        consecutive_hysteresis: refill the hysteresis budget on every step without overflow.
        raise_error_at_min_scale: an overflow that would lower a scale already at ``min_scale``
            raises (DeepSpeed's default); otherwise training goes on at ``min_scale``.
    """

    dynamic = True

    def __init__(
        self,
        init_scale: float | None = None,
        *,
        initial_scale_power: int | None = None,
        scale_factor: float = 2.0,
        scale_window: int = 1000,
        min_scale: float = 1.0,
        hysteresis: int = 2,
        consecutive_hysteresis: bool = False,
        raise_error_at_min_scale: bool = True,
    ):
        given_twice = init_scale is not None and initial_scale_power is not None
        if given_twice and float(init_scale) != 2.0**initial_scale_power:
            raise ConfigError(
                f"initial loss scale given twice: init_scale={init_scale} and "
                f"initial_scale_power={initial_scale_power} (2**{initial_scale_power}="
                f"{2.0**initial_scale_power:g})",
                where="fp16.initial_scale_power",
                fix="give only one of --initial-loss-scale and initial_scale_power",
            )
        if init_scale is None:
            init_scale = 2.0**initial_scale_power if initial_scale_power is not None else 2.0**32
        super().__init__(init_scale)
        _check(scale_factor > 1, "scale_factor", scale_factor, "a number > 1")
        _check(
            isinstance(scale_window, int) and scale_window >= 1,
            "loss_scale_window",
            scale_window,
            "an integer >= 1",
        )
        _check(
            0 < min_scale <= init_scale,
            "min_loss_scale",
            min_scale,
            "a number in (0, initial scale]",
        )
        _check(
            isinstance(hysteresis, int) and hysteresis >= 1,
            "hysteresis",
            hysteresis,
            "an integer >= 1",
        )
        self.scale_factor = float(scale_factor)
        self.scale_window = scale_window
        self.min_scale = float(min_scale)
        self.hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.raise_error_at_min_scale = raise_error_at_min_scale
        self.cur_iter = 0  # number of update() calls so far
        self.last_overflow_iter = -1
        self.cur_hysteresis = hysteresis  # overflows left before the scale drops

    def update(self, overflow: bool) -> None:
        if overflow:
            self._on_overflow()
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.hysteresis
            # Steps without overflow before this one, since the last overflow.
            stable_steps = self.cur_iter - self.last_overflow_iter - 1
            if stable_steps > 0 and stable_steps % self.scale_window == 0:
                self.cur_hysteresis = self.hysteresis
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    def _on_overflow(self) -> None:
        if self.cur_hysteresis > 1:
            # Spend one unit of hysteresis; the scale survives this overflow.
            self.cur_hysteresis -= 1
            logger.info(
                "OVERFLOW! Skipping step. Loss scale %g kept; hysteresis now %d",
                self.cur_scale,
                self.cur_hysteresis,
            )
            return
        if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
            raise ZerotronError(
                f"gradients overflow even at the minimum loss scale {self.min_scale:g}",
                where=f"step {self.cur_iter}",
                fix="training has diverged: lower the learning rate, enable gradient clipping, "
                "use bf16, or lower --min-loss-scale",
            )
        new_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
        logger.info("OVERFLOW! Skipping step. Loss scale %g -> %g", self.cur_scale, new_scale)
        self.cur_scale = new_scale

    def state_dict(self) -> dict[str, Any]:
        return {
            "dynamic": True,
            "cur_scale": self.cur_scale,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
            "cur_hysteresis": self.cur_hysteresis,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the scale and its counters; the settings (window, factor, ...) stay this
        run's, as with Megatron's scaler, so a resumed run may change them."""
        if not state.get("dynamic", False):
            # A static-scale checkpoint resumed with dynamic scaling: start from its scale.
            self.cur_scale = float(state.get("cur_scale", self.cur_scale))
            return
        try:
            self.cur_scale = float(state["cur_scale"])
            self.cur_iter = int(state["cur_iter"])
            self.last_overflow_iter = int(state["last_overflow_iter"])
            self.cur_hysteresis = int(state["cur_hysteresis"])
        except KeyError as e:
            raise CheckpointError(
                f"loss scaler state lacks key {e.args[0]!r}",
                where="optimizer.loss_scaler",
                fix="the checkpoint was not written by zerotron's DynamicLossScaler; "
                "load without optimizer state (--no-load-optim)",
            ) from None


def make_loss_scaler(
    params_dtype: torch.dtype,
    *,
    loss_scale: float | None = None,
    initial_scale: float | None = None,
    initial_scale_power: int | None = None,
    scale_window: int = 1000,
    hysteresis: int = 2,
    consecutive_hysteresis: bool = False,
    min_scale: float = 1.0,
    raise_error_at_min_scale: bool = True,
) -> LossScaler | None:
    """The scaler a run with parameters in ``params_dtype`` needs, or None.

    fp16: a static scaler when ``loss_scale`` is a positive number (Megatron's ``--loss-scale``;
    DeepSpeed's ``fp16.loss_scale``, where 0 means dynamic), else a dynamic one. bf16 and fp32
    need no scaling: None.
    """
    if params_dtype != torch.float16:
        return None
    if loss_scale:
        return StaticLossScaler(loss_scale)
    return DynamicLossScaler(
        initial_scale,
        initial_scale_power=initial_scale_power,
        scale_window=scale_window,
        min_scale=min_scale,
        hysteresis=hysteresis,
        consecutive_hysteresis=consecutive_hysteresis,
        raise_error_at_min_scale=raise_error_at_min_scale,
    )


def _check(ok: bool, key: str, value: object, rule: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r}: must be {rule}", where=key, fix=f"set {key} to {rule}")
