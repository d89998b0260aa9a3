"""``DeepSpeedAccelerator``: what every accelerator answers, and the parts they share.

The device-specific answers (device names, memory, streams, dtypes) are abstract here and
given by :class:`~.cpu_accelerator.CPU_Accelerator` and
:class:`~.cuda_accelerator.CUDA_Accelerator`; RNG access, pinning, timers' and compiler
settings are common. Method names, arguments and results are DeepSpeed's.
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Callable
from typing import Any

import torch

from zerotron.errors import ConfigError


class DeepSpeedAccelerator(abc.ABC):
    """One kind of device, as DeepSpeed's scripts and libraries ask about it."""

    supports_nvtx_domain = False

    def __init__(self) -> None:
        self._name: str | None = None
        self._communication_backend_name: str | None = None
        self._compile_backend: str | None = "inductor"

    # ---- device ---------------------------------------------------------------------------

    @abc.abstractmethod
    def is_synchronized_device(self) -> bool:
        """Whether work on the device runs in program order with the host (CPU: True)."""

    def use_host_timers(self) -> bool:
        """Whether host clocks time device work (only on synchronized devices)."""
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        return self.is_synchronized_device()

    @abc.abstractmethod
    def device_name(self, device_index: int | str | None = None) -> str:
        """``"cuda"`` / ``"cpu"``, or ``"cuda:<i>"`` with an index."""

    @abc.abstractmethod
    def device(self, device_index: int | None = None) -> Any:
        """The torch device (``device_index`` None: the current one)."""

    @abc.abstractmethod
    def set_device(self, device_index: int) -> None:
        """Make ``device_index`` this process's current device."""

    @abc.abstractmethod
    def current_device(self) -> int:
        """The index of this process's current device."""

    def current_device_name(self) -> str:
        """The current device as a torch device string (``"cuda:0"``, ``"cpu"``)."""
        return self.device_name(self.current_device())

    @abc.abstractmethod
    def device_count(self) -> int:
        """Devices visible to this process."""

    @abc.abstractmethod
    def synchronize(self, device_index: int | None = None) -> None:
        """Wait for all work queued on the device."""

    @abc.abstractmethod
    def is_available(self) -> bool:
        """Whether the device can be used."""

    def communication_backend_name(self) -> str:
        """The torch.distributed backend for this device (``"nccl"``, ``"gloo"``)."""
        assert self._communication_backend_name is not None
        return self._communication_backend_name

    def is_triton_supported(self) -> bool:
        """Whether DeepSpeed's Triton kernels would run here (zerotron uses none: False)."""
        return False

    # ---- RNG ------------------------------------------------------------------------------

    def random(self) -> Any:
        """torch's RNG module (``torch.random``)."""
        return torch.random

    @abc.abstractmethod
    def manual_seed(self, seed: int) -> Any:
        """Seed the device's generator."""

    @abc.abstractmethod
    def manual_seed_all(self, seed: int) -> Any:
        """Seed the generators of every device."""

    @abc.abstractmethod
    def initial_seed(self) -> int:
        """The seed of the current device's generator."""

    @abc.abstractmethod
    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        """The device generator's state."""

    @abc.abstractmethod
    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        """Restore the device generator's state."""

    @abc.abstractmethod
    def default_generator(self, device_index: int) -> torch.Generator:
        """The default generator of device ``device_index``."""

    # ---- streams, events, graphs ----------------------------------------------------------

    @property
    @abc.abstractmethod
    def Stream(self) -> Any:  # noqa: N802 - DeepSpeed's name
        """The stream class (None where the device has none)."""

    @abc.abstractmethod
    def stream(self, stream: Any) -> Any:
        """A context manager running work on ``stream``."""

    @abc.abstractmethod
    def current_stream(self, device_index: int | None = None) -> Any: ...

    @abc.abstractmethod
    def default_stream(self, device_index: int | None = None) -> Any: ...

    @property
    @abc.abstractmethod
    def Event(self) -> Any:  # noqa: N802 - DeepSpeed's name
        """The event class (None where the device has none)."""

    @abc.abstractmethod
    def amp(self) -> Any:
        """torch's autocast module for the device (``torch.cuda.amp``, ``torch.cpu.amp``)."""

    def range_push(self, msg: str, domain: str | None = None, category: Any = None) -> Any:
        """Open a profiler range (no-op where the device has no profiler ranges)."""
        return None

    def range_pop(self, domain: str | None = None) -> Any:
        """Close the innermost profiler range."""
        return None

    def lazy_call(self, callback: Callable[[], Any]) -> Any:
        """Run ``callback`` (when the device is initialized, on lazy devices)."""
        return callback()

    # ---- memory ---------------------------------------------------------------------------

    @abc.abstractmethod
    def empty_cache(self) -> None: ...

    @abc.abstractmethod
    def memory_allocated(self, device_index: int | None = None) -> int: ...

    @abc.abstractmethod
    def max_memory_allocated(self, device_index: int | None = None) -> int: ...

    @abc.abstractmethod
    def reset_max_memory_allocated(self, device_index: int | None = None) -> None: ...

    @abc.abstractmethod
    def memory_reserved(self, device_index: int | None = None) -> int: ...

    @abc.abstractmethod
    def max_memory_reserved(self, device_index: int | None = None) -> int: ...

    @abc.abstractmethod
    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]: ...

    @abc.abstractmethod
    def reset_peak_memory_stats(self, device_index: int | None = None) -> None: ...

    @abc.abstractmethod
    def total_memory(self, device_index: int | None = None) -> int: ...

    @abc.abstractmethod
    def available_memory(self, device_index: int | None = None) -> int: ...

    def memory_cached(self, device_index: int | None = None) -> int:
        """Old name of :meth:`memory_reserved`."""
        return self.memory_reserved(device_index)

    def max_memory_cached(self, device_index: int | None = None) -> int:
        """Old name of :meth:`max_memory_reserved`."""
        return self.max_memory_reserved(device_index)

    def reset_max_memory_cached(self, device_index: int | None = None) -> None:
        """Old name: resets the peaks (:meth:`reset_peak_memory_stats`)."""
        self.reset_peak_memory_stats(device_index)

    # ---- data types -----------------------------------------------------------------------

    @abc.abstractmethod
    def is_bf16_supported(self) -> bool: ...

    @abc.abstractmethod
    def is_fp16_supported(self) -> bool: ...

    def supported_dtypes(self) -> list[torch.dtype]:
        """float32, and bf16 / fp16 where supported."""
        dtypes = [torch.float]
        if self.is_fp16_supported():
            dtypes.append(torch.half)
        if self.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        return dtypes

    def _tensor_factory(self, dtype: torch.dtype) -> Callable[..., torch.Tensor]:
        """``torch.tensor(data)`` of ``dtype`` on this device (DeepSpeed's ``FloatTensor`` &c.)."""
        return functools.partial(torch.tensor, dtype=dtype, device=self.device_name())

    @property
    def BFloat16Tensor(self) -> Callable[..., torch.Tensor]:  # noqa: N802 - DeepSpeed's names
        return self._tensor_factory(torch.bfloat16)

    @property
    def ByteTensor(self) -> Callable[..., torch.Tensor]:  # noqa: N802
        return self._tensor_factory(torch.uint8)

    @property
    def DoubleTensor(self) -> Callable[..., torch.Tensor]:  # noqa: N802
        return self._tensor_factory(torch.double)

    @property
    def FloatTensor(self) -> Callable[..., torch.Tensor]:  # noqa: N802
        return self._tensor_factory(torch.float)

    @property
    def HalfTensor(self) -> Callable[..., torch.Tensor]:  # noqa: N802
        return self._tensor_factory(torch.half)

    @property
    def IntTensor(self) -> Callable[..., torch.Tensor]:  # noqa: N802
        return self._tensor_factory(torch.int)

    @property
    def LongTensor(self) -> Callable[..., torch.Tensor]:  # noqa: N802
        return self._tensor_factory(torch.long)

    # ---- tensors --------------------------------------------------------------------------

    def pin_memory(
        self, tensor: torch.Tensor, make_copy: bool = True, match_shape: bool = True
    ) -> torch.Tensor:
        """``tensor`` in page-locked host memory (a pinned copy; itself if already pinned)."""
        return tensor if tensor.is_pinned() else tensor.pin_memory()

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is in page-locked host memory."""
        return tensor.is_pinned()

    def unpin_memory(self, tensor: torch.Tensor) -> None:
        """Nothing to do: torch frees pinned memory with the tensor."""
        return None

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives on this accelerator's device type."""
        return tensor.device.type == self._name

    # ---- compiler, launcher ---------------------------------------------------------------

    def get_compile_backend(self) -> str | None:
        """The ``torch.compile`` backend DeepSpeed would use."""
        return self._compile_backend

    def set_compile_backend(self, backend: str) -> None:
        """Choose the ``torch.compile`` backend (one torch lists)."""
        available = torch._dynamo.list_backends(exclude_tags=())
        if backend not in available:
            raise ConfigError(
                f"torch.compile backend {backend!r} is not available on {self._name}",
                where="set_compile_backend",
                fix=f"use one of {', '.join(available)}",
            )
        self._compile_backend = backend

    def visible_devices_envs(self) -> list[str]:
        """Environment variables that choose the visible devices."""
        return ["CUDA_VISIBLE_DEVICES"]

    def set_visible_devices_envs(
        self, current_env: dict[str, str], local_accelerator_ids: list[int]
    ) -> None:
        """Make ``local_accelerator_ids`` the visible devices in ``current_env``."""
        for name in self.visible_devices_envs():
            current_env[name] = ",".join(map(str, local_accelerator_ids))

    def export_envs(self) -> list[str]:
        """Prefixes of environment variables a multi-node launcher forwards."""
        return []

    def create_op_builder(self, class_name: str) -> None:
        """DeepSpeed's compiled-op builders do not exist in zerotron: None (as for an op the
        device lacks). zerotron's optimizers and kernels need no build step."""
        return None

    def get_op_builder(self, class_name: str) -> None:
        """See :meth:`create_op_builder`: None."""
        return None
