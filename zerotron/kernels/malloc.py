"""glibc's malloc kept from handing the heap back to the OS between training steps (CPU).

glibc returns the top of its heap to the OS once more than ``M_TRIM_THRESHOLD`` bytes are free
there (a dynamic threshold: twice the mmap threshold, 64 MB at most). A training step frees its
activations at the end of backward, the heap shrinks, and the next forward's activations fault
every page in again (the kernel zeroes each one): bench/README.md measures how much of
bench/train_step.py's compiled fp32 GPT step that costs.

:func:`keep_freed_heap` sets ``M_TRIM_THRESHOLD`` to 1 GiB, so freed heap memory stays mapped
for the next step (resident memory stays at the step's peak instead of dipping between steps;
the peak itself does not rise). Setting any threshold also turns off glibc's dynamic mmap
threshold, so ``M_MMAP_THRESHOLD`` is set to 32 MB, the ceiling that dynamic threshold rises to
(allocations above it are still mapped and unmapped each time). It is process-wide, applied
once, by :func:`~zerotron.kernels.policy.apply_process_settings` (the Engine) when its model is
on the CPU and the job is one process; with several ranks on one host, which share its memory,
glibc's defaults stay: a fixed threshold puts more buffers in the heap, and kept heap raised a
rank's peak RSS in bench/zero.py while trimmed heap is what lets those ranks' resident memory
fall.
``ZEROTRON_KEEP_HEAP=0`` leaves malloc as it is; other C libraries (musl, macOS) are left alone.
The same page faults are why CPU training guides preload jemalloc or tcmalloc.
"""

from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
TRIM_THRESHOLD = 1 << 30
MMAP_THRESHOLD = 32 << 20

_applied: bool | None = None


def keep_freed_heap() -> bool:
    """Tune glibc's malloc as the module docstring says, once per process; returns whether it
    is in effect (False off glibc, or with ``ZEROTRON_KEEP_HEAP=0``)."""
    global _applied
    if _applied is None:
        _applied = _apply()
    return _applied


def _apply() -> bool:
    if os.environ.get("ZEROTRON_KEEP_HEAP", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)  # the C library this process runs on
        if not hasattr(libc, "gnu_get_libc_version"):  # glibc only: the parameters are its own
            return False
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
