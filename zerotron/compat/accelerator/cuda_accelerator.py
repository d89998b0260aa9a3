"""``CUDA_Accelerator``: an NVIDIA GPU through ``torch.cuda``, as DeepSpeed's interface names it."""

from __future__ import annotations

import os
from typing import Any

import torch

from zerotron.compat.accelerator.abstract_accelerator import DeepSpeedAccelerator


class CUDA_Accelerator(DeepSpeedAccelerator):  # noqa: N801 - DeepSpeed's name
    """CUDA devices: ``"cuda:<i>"``, communication over nccl."""

    def __init__(self) -> None:
        super().__init__()
        self._name = "cuda"
        self._communication_backend_name = "nccl"

    # ---- device ---------------------------------------------------------------------------

    def is_synchronized_device(self) -> bool:
        return False

    def device_name(self, device_index: int | str | None = None) -> str:
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device("cuda", device_index)

    def set_device(self, device_index: int) -> None:
        torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def synchronize(self, device_index: int | None = None) -> None:
        torch.cuda.synchronize(device_index)

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def is_triton_supported(self) -> bool:
        return False

    # ---- RNG ------------------------------------------------------------------------------

    def manual_seed(self, seed: int) -> None:
        torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return (
            torch.cuda.get_rng_state()
            if device_index is None
            else (torch.cuda.get_rng_state(device_index))
        )

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        if device_index is None:
            torch.cuda.set_rng_state(new_state)
        else:
            torch.cuda.set_rng_state(new_state, device_index)

    def default_generator(self, device_index: int) -> torch.Generator:
        return torch.cuda.default_generators[device_index]

    # ---- streams, events, profiler ranges -------------------------------------------------

    @property
    def Stream(self) -> Any:  # noqa: N802
        return torch.cuda.Stream

    def stream(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def current_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.current_stream(device_index)

    def default_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.default_stream(device_index)

    @property
    def Event(self) -> Any:  # noqa: N802
        return torch.cuda.Event

    def amp(self) -> Any:
        return torch.cuda.amp

    def range_push(self, msg: str, domain: str | None = None, category: Any = None) -> Any:
        return torch.cuda.nvtx.range_push(msg)

    def range_pop(self, domain: str | None = None) -> Any:
        return torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback: Any) -> Any:
        return torch.cuda._lazy_call(callback)

    # ---- memory ---------------------------------------------------------------------------

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index)

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index)

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_reserved(device_index)

    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        return torch.cuda.memory_stats(device_index)

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        return torch.cuda.get_device_properties(device_index).total_memory

    def available_memory(self, device_index: int | None = None) -> int:
        """Free device memory as the driver reports it."""
        index = self.current_device() if device_index is None else device_index
        return torch.cuda.mem_get_info(index)[0]

    # ---- data types -----------------------------------------------------------------------

    def is_bf16_supported(self) -> bool:
        return not torch.cuda.is_available() or torch.cuda.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        """Compute capability 7 and up (6.x with ``DS_ALLOW_DEPRECATED_FP16=1``)."""
        if not torch.cuda.is_available():
            return True
        major, _ = torch.cuda.get_device_capability()
        deprecated = os.environ.get("DS_ALLOW_DEPRECATED_FP16", "0") == "1"
        return major >= 7 or (major == 6 and deprecated)

    def export_envs(self) -> list[str]:
        return ["NCCL"]
