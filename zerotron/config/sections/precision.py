"""The ``precision`` section: parameter dtype and dynamic loss scaling (DeepSpeed's semantics
for fp16)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from zerotron.config.sections.base import Float, Int, Section


class PrecisionConfig(Section):
    """Mixed precision and dynamic loss scaling (DeepSpeed's semantics for fp16)."""

    fp16: bool = Field(False, description="16-bit float params, fp32 master weights.")
    bf16: bool = Field(False, description="bfloat16 params, fp32 master weights.")
    loss_scale: Float | None = Field(
        None, gt=0, description="Static loss scale for fp16; dynamic scaling when not given."
    )
    initial_loss_scale: Float = Field(2.0**32, gt=0, description="First dynamic loss scale.")
    min_loss_scale: Float = Field(1.0, gt=0, description="Floor of the dynamic loss scale.")
    loss_scale_window: Int = Field(
        1000, gt=0, description="Overflow-free steps before the scale doubles."
    )
    hysteresis: Int = Field(2, ge=1, description="Overflows tolerated before the scale halves.")
    consecutive_hysteresis: bool = Field(
        False, description="Refill hysteresis after each overflow-free step (DeepSpeed's)."
    )
    accumulate_allreduce_grads_in_fp32: bool = Field(
        False, description="Accumulate and all-reduce gradients in fp32."
    )
    fp16_auto_cast: bool = Field(
        False, description="fp16: cast floating-point inputs of the model to fp16 (DeepSpeed)."
    )

    @property
    def params_dtype(self) -> Literal["fp32", "fp16", "bf16"]:
        """The dtype model parameters are kept in."""
        return "fp16" if self.fp16 else "bf16" if self.bf16 else "fp32"
