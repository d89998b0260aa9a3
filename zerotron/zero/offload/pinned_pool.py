"""A pool of reusable host buffers (pinned with CUDA) that NVMe offload streams sub-groups through.

A :class:`PoolSlot` is one large host buffer from which the tensors of one resident sub-group
(master and optimizer states) are carved at cache-line-aligned offsets; the offloaded optimizer
keeps ``buffer_count`` slots and cycles through them, so the host memory it holds stays fixed
whatever the model's size.
"""

from __future__ import annotations

import mmap
import warnings
from collections.abc import Sequence

import torch

from zerotron.zero.offload.swap import TensorSpec

_ALIGN = 64  # bytes: every tensor carved from a pool slot starts on a cache line


def _host_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    """``nbytes`` of host memory that goes back to the OS when the tensor dies: an anonymous
    mapping (or pinned memory from CUDA's host allocator). Pool slots are few and large; from
    malloc, glibc would keep the freed ones (its mmap threshold rises after the first free)
    and the process would grow by a few sub-groups each time a slot is resized."""
    if pin:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():  # "the given buffer is not writable": it is
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)


class PoolSlot:
    """One reusable host buffer; tensors are carved from it at aligned offsets."""

    def __init__(self, pin: bool):
        self.pin = pin
        self.buf: torch.Tensor | None = None

    def carve(self, specs: Sequence[TensorSpec]) -> list[torch.Tensor]:
        offsets, end = [], 0
        for s in specs:
            offsets.append(end)
            end += -(-s.nbytes // _ALIGN) * _ALIGN
        if self.buf is None or self.buf.numel() < end:
            self.buf = None  # drop the old one before allocating the bigger one
            self.buf = _host_buffer(end, self.pin)
        return [
            self.buf[o : o + s.nbytes].view(s.dtype).view(s.shape) for o, s in zip(offsets, specs)
        ]

    @property
    def nbytes(self) -> int:
        return 0 if self.buf is None else self.buf.numel()
