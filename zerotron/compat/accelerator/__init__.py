"""``deepspeed.accelerator``: the device abstraction DeepSpeed scripts and libraries call.

:func:`get_accelerator` (also ``zerotron.get_accelerator``) returns the process's accelerator,
chosen as DeepSpeed chooses it: CUDA when a GPU is visible, else the CPU; the environment
variable ``DS_ACCELERATOR`` (``cuda`` or ``cpu``) overrides. :func:`set_accelerator` replaces it.
The classes are at DeepSpeed's paths: :class:`~.abstract_accelerator.DeepSpeedAccelerator`,
:class:`~.cpu_accelerator.CPU_Accelerator`, :class:`~.cuda_accelerator.CUDA_Accelerator`.
"""

from zerotron.compat.accelerator.abstract_accelerator import DeepSpeedAccelerator
from zerotron.compat.accelerator.real_accelerator import (
    get_accelerator,
    is_current_accelerator_supported,
    set_accelerator,
)
from zerotron.compat.submodules import submodule_getattr

__all__ = [
    "DeepSpeedAccelerator",
    "get_accelerator",
    "is_current_accelerator_supported",
    "set_accelerator",
]

__getattr__ = submodule_getattr(__name__)
