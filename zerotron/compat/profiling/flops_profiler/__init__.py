"""DeepSpeed's ``deepspeed.profiling.flops_profiler``: :class:`FlopsProfiler` and
:func:`get_model_profile` (the profiler itself is :mod:`zerotron.engine.flops_profiler`)."""

from zerotron.compat.profiling.flops_profiler.profiler import (
    FlopsProfiler,
    duration_to_string,
    flops_to_string,
    get_model_profile,
    macs_to_string,
    number_to_string,
    params_to_string,
)

__all__ = [
    "FlopsProfiler",
    "duration_to_string",
    "flops_to_string",
    "get_model_profile",
    "macs_to_string",
    "number_to_string",
    "params_to_string",
]
