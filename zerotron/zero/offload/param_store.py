"""ZeRO-3 ``offload_param``: this rank's 16-bit parameter shards kept in host memory or files.

Stage 3 (:mod:`zerotron.zero.stage3`) puts a shard here between uses and reads it back when it
gathers the parameter; :class:`ParamOffloadStore` is the concrete
:class:`~zerotron.zero.stage3.ShardStore`.
"""

from __future__ import annotations

import torch

from zerotron.zero.offload.swap import NVMeSwapper, default_rank_name
from zerotron.zero.options import OffloadOptions


class ParamOffloadStore:
    """ZeRO-3 ``offload_param``: this rank's 16-bit parameter shards, kept by key.

    - ``none``: keeps the tensor it was given (no copy).
    - ``cpu``: keeps a host copy (pinned with ``pin_memory``), reusing its buffer on each put.
    - ``nvme``: keeps a file per key (checked writes, see :class:`NVMeSwapper`).

    :meth:`get` returns the stored tensor itself for ``none``/``cpu`` (treat it as read-only;
    :meth:`put` to change it) and a fresh tensor (or ``out``) for ``nvme``.
    """

    def __init__(
        self,
        options: OffloadOptions,
        rank_name: str | None = None,
        *,
        where: str = "zero_optimization.offload_param",
    ):
        options.validate(where)
        rank_name = rank_name or default_rank_name()
        self.options = options
        self.device = options.device
        self._pin = options.pin_memory and torch.cuda.is_available()
        self._held: dict[str, torch.Tensor] = {}
        self._swapper = (
            NVMeSwapper(options.nvme_path, f"{rank_name}.params", where=f"{where}.nvme_path")
            if self.device == "nvme"
            else None
        )

    def put(self, key: str | int, tensor: torch.Tensor) -> None:
        """Store ``tensor``'s values under ``key`` (replacing what was there)."""
        key = str(key)
        if self.device == "nvme":
            self._swapper.swap_out(key, tensor)
        elif self.device == "cpu":
            held = self._held.get(key)
            if held is None or held.shape != tensor.shape or held.dtype != tensor.dtype:
                held = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self._pin)
                self._held[key] = held
            held.copy_(tensor.detach())
        else:
            self._held[key] = tensor

    def get(self, key: str | int, out: torch.Tensor | None = None) -> torch.Tensor:
        """The values stored under ``key``; copied into ``out`` (any device) if given."""
        key = str(key)
        if self.device == "nvme":
            if out is not None and out.device.type == "cpu" and out.is_contiguous():
                return self._swapper.swap_in(key, out)
            t = self._swapper.swap_in(key)
            return t if out is None else out.copy_(t)
        t = self._held[key]
        return t if out is None else out.copy_(t)

    def __contains__(self, key: str | int) -> bool:
        key = str(key)
        return key in self._swapper if self._swapper is not None else key in self._held

    def release(self, key: str | int) -> None:
        """Forget ``key`` (and delete its file)."""
        key = str(key)
        if self._swapper is not None:
            self._swapper.release(key)
        self._held.pop(key, None)

    def resident_bytes(self) -> int:
        """Bytes held in memory (0 with ``nvme``: nothing is kept between calls)."""
        return sum(t.numel() * t.element_size() for t in self._held.values())

    def bytes_on_disk(self) -> int:
        return 0 if self._swapper is None else self._swapper.bytes_on_disk()

    def close(self) -> None:
        """Drop everything and delete the swap files."""
        self._held.clear()
        if self._swapper is not None:
            self._swapper.cleanup()
