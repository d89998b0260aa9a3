"""``CPU_Accelerator``: the CPU as DeepSpeed's accelerator interface describes it.

Memory queries report the process's resident set size (RSS, via psutil), with the peak as this
object last saw it, as DeepSpeed's CPU accelerator does; the totals are the machine's. There
are no streams, events or profiler ranges: those are None or no-ops.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import psutil
import torch

from zerotron.compat.accelerator.abstract_accelerator import DeepSpeedAccelerator
from zerotron.distributed.init import local_rank


class CPU_Accelerator(DeepSpeedAccelerator):  # noqa: N801 - DeepSpeed's name
    """The CPU: device ``"cpu"``, communication over gloo."""

    def __init__(self) -> None:
        super().__init__()
        self._name = "cpu"
        self._communication_backend_name = "gloo"
        self.max_mem = psutil.Process().memory_info().rss

    # ---- device ---------------------------------------------------------------------------

    def is_synchronized_device(self) -> bool:
        return True

    def device_name(self, device_index: int | str | None = None) -> str:
        return "cpu"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device("cpu")

    def set_device(self, device_index: int) -> None:
        return None

    def current_device(self) -> int:
        """The process's local rank: each process is "its" CPU device."""
        return local_rank()

    def current_device_name(self) -> str:
        return "cpu"

    def device_count(self) -> int:
        """``LOCAL_SIZE`` (DeepSpeed's launcher sets it), else 1."""
        return int(os.environ.get("LOCAL_SIZE") or 0) or 1

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def is_available(self) -> bool:
        return True

    # ---- RNG ------------------------------------------------------------------------------

    def manual_seed(self, seed: int) -> torch.Generator:
        return torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> torch.Generator:
        return torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        torch.set_rng_state(new_state)

    def default_generator(self, device_index: int) -> torch.Generator:
        return torch.default_generator

    # ---- streams, events ------------------------------------------------------------------

    @property
    def Stream(self) -> None:  # noqa: N802
        return None

    def stream(self, stream: Any) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def current_stream(self, device_index: int | None = None) -> None:
        return None

    def default_stream(self, device_index: int | None = None) -> None:
        return None

    @property
    def Event(self) -> None:  # noqa: N802
        return None

    def amp(self) -> Any:
        return torch.cpu.amp

    # ---- memory: the process's RSS --------------------------------------------------------

    def _rss(self) -> int:
        rss = psutil.Process().memory_info().rss
        self.max_mem = max(self.max_mem, rss)
        return rss

    def _reset_peak(self) -> None:
        self.max_mem = psutil.Process().memory_info().rss

    def empty_cache(self) -> None:
        return None

    def memory_allocated(self, device_index: int | None = None) -> int:
        return self._rss()

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        self._rss()
        return self.max_mem

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        self._reset_peak()

    def memory_reserved(self, device_index: int | None = None) -> int:
        return self._rss()

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        self._rss()
        return self.max_mem

    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        current = self._rss()
        return {"allocated_bytes.all.current": current, "allocated_bytes.all.peak": self.max_mem}

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        self._reset_peak()

    def total_memory(self, device_index: int | None = None) -> int:
        return psutil.virtual_memory().total

    def available_memory(self, device_index: int | None = None) -> int:
        return psutil.virtual_memory().available

    # ---- data types, tensors --------------------------------------------------------------

    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        """Whether oneDNN has fp16 kernels on this CPU."""
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
        except (AttributeError, RuntimeError):
            return False

    def supported_dtypes(self) -> list[torch.dtype]:
        """float32 and bf16, and fp16 where oneDNN has it (DeepSpeed's order)."""
        dtypes = [torch.float, torch.bfloat16]
        if self.is_fp16_supported():
            dtypes.append(torch.float16)
        return dtypes

    def pin_memory(
        self, tensor: torch.Tensor, make_copy: bool = True, match_shape: bool = True
    ) -> torch.Tensor:
        """``tensor`` itself: there is no device to pin host memory for."""
        return tensor

    # DeepSpeed's CPU accelerator hands out torch's legacy CPU tensor types (size arguments).
    @property
    def BFloat16Tensor(self) -> Any:  # noqa: N802 - DeepSpeed's names
        return torch.BFloat16Tensor

    @property
    def ByteTensor(self) -> Any:  # noqa: N802
        return torch.ByteTensor

    @property
    def DoubleTensor(self) -> Any:  # noqa: N802
        return torch.DoubleTensor

    @property
    def FloatTensor(self) -> Any:  # noqa: N802
        return torch.FloatTensor

    @property
    def HalfTensor(self) -> Any:  # noqa: N802
        return torch.HalfTensor

    @property
    def IntTensor(self) -> Any:  # noqa: N802
        return torch.IntTensor

    @property
    def LongTensor(self) -> Any:  # noqa: N802
        return torch.LongTensor
