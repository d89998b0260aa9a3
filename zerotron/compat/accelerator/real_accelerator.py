"""Which accelerator this process uses: :func:`get_accelerator` and :func:`set_accelerator`."""

from __future__ import annotations

import os

import torch

from zerotron.compat.accelerator.abstract_accelerator import DeepSpeedAccelerator
from zerotron.errors import ConfigError

SUPPORTED_ACCELERATOR_LIST = ("cuda", "cpu")
# DeepSpeed's other accelerators, which need device plugins zerotron does not drive.
_DEEPSPEED_ONLY = ("xpu", "npu", "mps", "hpu", "mlu", "sdaa", "supa")

_accelerator: DeepSpeedAccelerator | None = None


def get_accelerator() -> DeepSpeedAccelerator:
    """This process's accelerator (created on first use, then the same object)."""
    global _accelerator
    if _accelerator is None:
        _accelerator = _create(_pick())
    return _accelerator


def set_accelerator(accel_obj: DeepSpeedAccelerator | None) -> None:
    """Make ``accel_obj`` the accelerator :func:`get_accelerator` returns (None: choose again)."""
    global _accelerator
    if accel_obj is not None and not isinstance(accel_obj, DeepSpeedAccelerator):
        raise ConfigError(
            f"{type(accel_obj).__name__} is not a DeepSpeedAccelerator",
            where="set_accelerator",
            fix="pass an instance of a DeepSpeedAccelerator subclass (CPU_Accelerator, "
            "CUDA_Accelerator, or your own)",
        )
    _accelerator = accel_obj


def is_current_accelerator_supported() -> bool:
    """Whether the current accelerator is one of :data:`SUPPORTED_ACCELERATOR_LIST`."""
    return get_accelerator().device_name() in SUPPORTED_ACCELERATOR_LIST


def _pick() -> str:
    name = os.environ.get("DS_ACCELERATOR")
    if name is None:
        return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "cpu"
    if name in _DEEPSPEED_ONLY:
        raise ConfigError(
            f"DS_ACCELERATOR={name}: zerotron runs on CUDA and CPU only",
            where="environment",
            fix="unset DS_ACCELERATOR or set it to cuda or cpu",
        )
    if name not in SUPPORTED_ACCELERATOR_LIST:
        raise ConfigError(
            f"DS_ACCELERATOR={name!r} is not an accelerator",
            where="environment",
            fix=f"set it to one of {', '.join(SUPPORTED_ACCELERATOR_LIST)}",
        )
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "DS_ACCELERATOR=cuda, but CUDA is not available",
            where="environment",
            fix="unset DS_ACCELERATOR, or run on a machine with a GPU",
        )
    return name


def _create(name: str) -> DeepSpeedAccelerator:
    if name == "cuda":
        from zerotron.compat.accelerator.cuda_accelerator import CUDA_Accelerator

        return CUDA_Accelerator()
    from zerotron.compat.accelerator.cpu_accelerator import CPU_Accelerator

    return CPU_Accelerator()
