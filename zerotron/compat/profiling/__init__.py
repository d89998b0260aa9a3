"""DeepSpeed's ``deepspeed.profiling`` (importable as ``zerotron.profiling``): the FLOPs
profiler, :mod:`~zerotron.compat.profiling.flops_profiler`."""

from zerotron.compat.submodules import submodule_getattr

__getattr__ = submodule_getattr(__name__)
