"""DeepSpeed's ``deepspeed.profiling.flops_profiler.profiler``: the names scripts import from
it, served by :mod:`zerotron.engine.flops_profiler` (counting) and
:mod:`zerotron.engine.flops_profile_text` (the printout's number formats)."""

from zerotron.engine.flops_profile_text import (
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
)
from zerotron.engine.flops_profiler import FlopsProfiler, get_model_profile

__all__ = [
    "FlopsProfiler",
    "duration_to_string",
    "flops_to_string",
    "get_model_profile",
    "macs_to_string",
    "number_to_string",
    "params_to_string",
]
