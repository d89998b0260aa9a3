"""What the benchmarks share: the machine a number was measured on, and the kernel choices their
ranks run (zerotron.kernels.chooser, taken as ``zerotron pretrain`` takes them)."""

from __future__ import annotations

import os

import torch

from zerotron.distributed import comm
from zerotron.kernels import KernelShape, choose_kernels


def _cpuinfo() -> tuple[str, set[str]]:
    """The CPU's model name with its family, model and stepping ("unknown" where there is no
    name), and its flags, from /proc/cpuinfo. A VM's name can be as bare as "AMD EPYC": the
    numbers tell a Zen 3 (family 25 model 1) from a Zen 4 (family 25 model 17)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if not key:  # the first processor's block ends here
                    break
                fields.setdefault(key, value.strip())
    except OSError:
        pass
    model = fields.get("model name", "unknown")
    numbers = [f"{k} {fields[k]}" for k in ("cpu family", "model", "stepping") if k in fields]
    if numbers:
        model += f" ({', '.join(numbers)})"
    return model, set(fields.get("flags", "").split())


def cpu_model() -> str:
    """The CPU's model name, family, model and stepping from /proc/cpuinfo ("unknown" where
    there is no name)."""
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
