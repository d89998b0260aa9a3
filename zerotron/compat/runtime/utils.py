"""DeepSpeed's ``deepspeed.runtime.utils``: :func:`set_random_seed`, :func:`see_memory_usage`."""

from __future__ import annotations

import gc
import random

import numpy as np
import psutil
import torch


def set_random_seed(seed: int) -> None:
    """Seed Python's ``random``, numpy and torch with ``seed``, as DeepSpeed does (numpy takes
    it modulo 2**32, torch modulo 2**63: larger seeds are accepted).

    Unlike ``zerotron pretrain``'s Megatron seeding there is no per-stage offset and no
    tensor-parallel stream: every rank that passes the same seed draws the same numbers.
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed % 2**63)


def see_memory_usage(message: str, force: bool = False) -> None:
    """Print ``message`` and the accelerator's and the host's memory on rank 0, as DeepSpeed
    does: allocated (MA) and its peak, reserved (CA) and its peak, in GB, then the host's used
    memory; the peaks are reset after. Nothing unless ``force`` (DeepSpeed's default is off too).
    On the CPU accelerator "allocated" is the process's resident memory."""
    if not force:
        return
    import torch.distributed as dist

    from zerotron.compat.accelerator import get_accelerator

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    gc.collect()  # what Python still holds but no longer uses would count otherwise
    acc = get_accelerator()
    gb = 1024**3
    print(message)
    print(
        f"MA {acc.memory_allocated() / gb:.2f} GB  Max_MA {acc.max_memory_allocated() / gb:.2f} GB"
        f"  CA {acc.memory_reserved() / gb:.2f} GB  Max_CA {acc.max_memory_reserved() / gb:.2f} GB"
    )
    vm = psutil.virtual_memory()
    used = (vm.total - vm.available) / gb
    print(f"CPU Virtual Memory:  used = {used:.2f} GB, percent = {vm.percent}%")
    acc.reset_peak_memory_stats()
