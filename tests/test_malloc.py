"""The Engine keeps glibc's freed heap for the next step: no page faults for reallocations."""

import ctypes
import os
import subprocess
import sys
import textwrap

import pytest

LOOP = textwrap.dedent(
    """
    import ctypes, resource
    from zerotron.kernels.malloc import keep_freed_heap
    applied = keep_freed_heap()
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    def step():  # a step's activations: three 20 MB buffers, written, then freed
        bufs = [libc.malloc(20 << 20) for _ in range(3)]
        for b in bufs:
            libc.memset(b, 1, 20 << 20)
        for b in bufs:
            libc.free(b)
    step(); step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        step()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    print(applied, faults * resource.getpagesize() / 5 / 2**20)  # MB faulted in per step
    """
)


def run_loop(keep: str) -> tuple[bool, float]:
    env = dict(os.environ, ZEROTRON_KEEP_HEAP=keep, OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-c", LOOP], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    return out[0] == "True", float(out[1])


@pytest.mark.timing  # page-fault counts: a serial pass, away from the other tests' load
@pytest.mark.skipif(
    not hasattr(ctypes.CDLL(None), "gnu_get_libc_version"), reason="needs glibc (Linux)"
)
def test_freed_heap_is_kept_between_steps():
    applied, kept = run_loop("1")
    off, trimmed = run_loop("0")
    assert applied and not off
    assert trimmed > 40  # glibc gave the heap back: each step faults its 60 MB in again
    assert kept < 1  # kept: the next step reuses the same pages


ENGINE = textwrap.dedent(
    """
    import torch
    from zerotron.kernels import malloc
    from zerotron.engine import Engine
    from zerotron.precision import MixedPrecisionOptimizer
    model = torch.nn.Linear(4, 4)
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    before = malloc._applied
    Engine(model, opt, micro_batch_size=1)
    print(before, malloc._applied)
    """
)


@pytest.mark.parametrize("keep,applied", [("1", "True"), ("0", "False")])
def test_engine_on_cpu_in_one_process_keeps_the_heap(keep, applied):
    env = dict(os.environ, ZEROTRON_KEEP_HEAP=keep, OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-c", ENGINE], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == ["None", applied]
