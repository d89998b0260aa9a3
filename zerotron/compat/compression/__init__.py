"""DeepSpeed's ``deepspeed.compression`` (importable as ``zerotron.compression``): only the
module helpers scripts import (:mod:`~zerotron.compat.compression.helper`); DeepSpeed's
compression training (quantization, pruning schedules) does not exist in zerotron."""

from zerotron.compat.submodules import submodule_getattr

__getattr__ = submodule_getattr(__name__)
