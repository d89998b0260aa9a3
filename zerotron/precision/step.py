"""The step sequence every optimizer wrapper shares: unscale, overflow check, skip, norm, clip.

:class:`~zerotron.precision.mixed.MixedPrecisionOptimizer` and ZeRO's optimizer differ in where
their fp32 gradients live (whole ``main_grad`` buffers, or this rank's partitions) and in how
they update, not in the checks between backward and update. Those are here, once:

1. **Unscale and check.** fp16 with a loss scale other than 1: the fp32 gradients are multiplied
   by ``1 / scale`` in place and checked for inf/nan in one fused pass; otherwise, when checking
   is on (a scaler, or an fp16 parameter), they are only checked. The flag is combined across
   every rank holding a part of the model (``reduce_fn``), and the scaler learns it.
2. **Skip.** An overflow skips the step: no weight or optimizer state (not even Adam's step
   count) changes, gradients are dropped, ``num_skipped_steps`` counts it.
3. **Norm.** The global norm of the gradients this rank counts (each element once across ranks,
   ``is_counted``), in fp64 (:func:`~zerotron.precision.grads.get_grad_norm`).
4. **Clip.** With ``clip_grad > 0`` the gradients are scaled by ``clip_grad / (norm + 1e-6)``
   when that is below 1 (:func:`~zerotron.precision.grads.clip_grad_norm_`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch
from torch import Tensor

from zerotron.precision.grads import (
    ReduceFn,
    clip_grad_norm_,
    get_grad_norm,
    has_overflow,
    unscale_and_check_overflow_,
)
from zerotron.precision.loss_scaler import LossScaler, ScalesLoss


class StepResult(NamedTuple):
    """What one optimizer step did (unpacks like Megatron's ``optimizer.step()`` result)."""

    update_successful: bool
    """False when the step was skipped because a gradient overflowed."""
    grad_norm: float | None
    """Global gradient norm before clipping; None for a skipped step."""
    num_zeros_in_grad: int | None
    """Zero gradient elements, when ``log_num_zeros_in_grad`` is on; else None."""


SKIPPED = StepResult(False, None, None)
"""The result of a step skipped on overflow."""


def checks_overflow(loss_scaler: LossScaler | None, params: Iterable[Tensor]) -> bool:
    """The default for ``check_overflow``: on with a loss scaler or any fp16 parameter."""
    return loss_scaler is not None or any(p.dtype == torch.float16 for p in params)


class StepSequence(ScalesLoss):
    """Steps 1-4 of the module docstring for an optimizer wrapper that has ``loss_scaler``,
    ``clip_grad``, ``norm_type``, ``check_overflow``, ``num_skipped_steps`` and ``zero_grad()``.

    The wrapper's ``step`` gathers its fp32 gradients, calls :meth:`_skip_on_overflow`, then
    :meth:`_grad_norm` and :meth:`_clip` (or clips later, piece by piece, when
    :meth:`_clips` says so), and updates.
    """

    clip_grad: float
    norm_type: float
    check_overflow: bool
    num_skipped_steps: int

    def zero_grad(self) -> None:
        raise NotImplementedError

    @property
    def _unscales(self) -> bool:
        """Whether step 1 unscales (fp16 with a scale other than 1): the gradients it reads
        must then be fp32 tensors that the update reads afterwards."""
        return self.loss_scaler is not None and self.loss_scaler.loss_scale != 1.0

    def _skip_on_overflow(self, grads: list[Tensor], reduce_fn: ReduceFn | None) -> bool:
        """Steps 1-2: unscale and check ``grads``, tell the scaler; on overflow count the
        skipped step, drop the gradients and return True (the caller returns :data:`SKIPPED`)."""
        overflow = False
        if self._unscales:
            inv_scale = 1.0 / self.loss_scaler.loss_scale
            overflow = unscale_and_check_overflow_(grads, inv_scale, reduce_fn=reduce_fn)
        elif self.check_overflow:
            overflow = has_overflow(grads, reduce_fn=reduce_fn)
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow)
        if overflow:
            self.num_skipped_steps += 1
            self.zero_grad()
        return overflow

    def _grad_norm(self, counted: list[Tensor], reduce_fn: ReduceFn | None) -> Tensor:
        """Step 3: the global norm of the gradients this rank counts (0-dim fp64)."""
        return get_grad_norm(counted, self.norm_type, reduce_fn=reduce_fn)

    def _clips(self, grad_norm: Tensor) -> bool:
        """Whether step 4 changes anything for this norm."""
        return self.clip_grad > 0 and self.clip_grad / (float(grad_norm) + 1e-6) < 1.0

    def _clip(self, grads: list[Tensor], grad_norm: Tensor) -> None:
        """Step 4 on ``grads`` (in place), given the global norm."""
        if self.clip_grad > 0:
            clip_grad_norm_(grads, self.clip_grad, total_norm=grad_norm)
