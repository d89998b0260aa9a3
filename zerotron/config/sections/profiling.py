"""DeepSpeed's ``flops_profiler`` block: profile one training step's forward, per module.

The engine reads it (:mod:`zerotron.engine.flops_profiler`): when enabled, rank 0 profiles the
forward of step ``profile_step`` (``global_steps`` counts finished steps, so 1 is the second
step, as in DeepSpeed) and prints the profile, or writes it to ``output_file``, when that step
ends. Keys and defaults are DeepSpeed's (``deepspeed/profiling/constants.py``); each field is
``flops_profiler_<key>``.
"""

from __future__ import annotations

from pydantic import Field

from zerotron.config.sections.base import Float, Int, Section


class FlopsProfilerConfig(Section):
    """DeepSpeed's ``flops_profiler`` section, key for key."""

    flops_profiler_enabled: bool = Field(
        False, description="Profile one step's forward: parameters, FLOPs and latency per module."
    )
    flops_profiler_recompute_fwd_factor: Float = Field(
        0.0,
        ge=0,
        description="Forwards recomputed in backward (1.0: full activation recompute); the "
        "backward counts 2 + this many forwards.",
    )
    flops_profiler_profile_step: Int = Field(
        1, ge=0, description="The step profiled (finished steps before it; 1 is the second)."
    )
    flops_profiler_module_depth: Int = Field(
        -1, ge=-1, description="Depths of the aggregated profile (-1: every depth)."
    )
    flops_profiler_top_modules: Int = Field(
        1, gt=0, description="Module types listed per depth in the aggregated profile."
    )
    flops_profiler_detailed: bool = Field(
        True, description="Also print every module's profile in the model's tree."
    )
    flops_profiler_output_file: str | None = Field(
        None, description="Write the profile to this file (default: print it)."
    )
