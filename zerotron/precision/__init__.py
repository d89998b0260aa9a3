"""Mixed precision: loss scalers, fp32 master weights, and gradient checks across ranks.

- :mod:`~zerotron.precision.loss_scaler`: static and dynamic (DeepSpeed-semantics) loss scaling.
- :mod:`~zerotron.precision.grads`: global gradient norm, clipping, overflow check, zero count,
  each pluggable across process groups (``reduce_fn``, ``is_counted``); 16-bit gradients added
  into fp32 buffers (``accumulate_grad_``).
- :mod:`~zerotron.precision.mixed`: :class:`MixedPrecisionOptimizer`, the optimizer wrapper the
  Engine steps in fp32, bf16 and fp16 alike.
- :mod:`~zerotron.precision.step`: :class:`StepSequence`, the unscale / overflow / skip / norm /
  clip sequence that every optimizer wrapper (this one and ZeRO's) runs, and :class:`StepResult`.
"""

from zerotron.precision.grads import (
    IsCounted,
    ReduceFn,
    clip_grad_norm_,
    count_zeros,
    get_grad_norm,
    has_overflow,
    unscale_and_check_overflow_,
)
from zerotron.precision.loss_scaler import (
    DynamicLossScaler,
    LossScaler,
    StaticLossScaler,
    make_loss_scaler,
)
from zerotron.precision.mixed import MixedPrecisionOptimizer
from zerotron.precision.step import StepResult, StepSequence

__all__ = [
    "DynamicLossScaler",
    "IsCounted",
    "LossScaler",
    "MixedPrecisionOptimizer",
    "ReduceFn",
    "StaticLossScaler",
    "StepResult",
    "StepSequence",
    "clip_grad_norm_",
    "count_zeros",
    "get_grad_norm",
    "has_overflow",
    "make_loss_scaler",
    "unscale_and_check_overflow_",
]
