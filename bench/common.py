"""What the benchmarks share: the machine a number was measured on, and the kernel choices their
ranks run (zerotron.kernels.chooser, taken as ``zerotron pretrain`` takes them)."""

from __future__ import annotations

import os

import torch

from zerotron.distributed import comm
from zerotron.kernels import KernelShape, choose_kernels


def _cpuinfo() -> tuple[str, set[str]]:
    """The CPU's model name ("unknown" where there is none) and flags, from /proc/cpuinfo."""
    model, flags = "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model == "unknown":
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return model, flags


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ("unknown" where there is none)."""
    return _cpuinfo()[0]


def machine() -> str:
    """The CPU model, its core count and vector flags, and the load: numbers need them."""
    model, flags = _cpuinfo()
    vector = sorted(f for f in flags if f.startswith(("avx2", "avx512", "amx")))
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"CPU: {model}, {os.cpu_count()} logical cores, {' '.join(vector) or 'no AVX2'}; "
        f"load average {load}"
    )


def measure_kernels(shape: KernelShape) -> str:
    """The kernel choices for ``shape``, from the cache or measured here with ``shape.threads``
    threads, before any rank starts (so no rank's timing or peak memory includes the
    measurement); returns the chooser's line. The ranks then take them with :func:`job_kernels`
    (rank 0 finds them cached)."""
    before = torch.get_num_threads()
    torch.set_num_threads(shape.threads)
    try:
        return choose_kernels(shape, "cpu", apply=False).line()
    finally:
        torch.set_num_threads(before)


def job_kernels(shape: KernelShape) -> None:
    """In a rank: the job's kernel choices, rank 0's for every rank, as ``zerotron pretrain``
    takes them (:func:`~zerotron.kernels.chooser.choose_kernels` with the world group)."""
    choose_kernels(shape, "cpu", group=comm.world_group())
