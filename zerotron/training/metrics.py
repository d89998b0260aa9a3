"""The run's metrics file: what ``zerotron pretrain`` and the Engine record for ``zerotron report``.

One JSON-lines file per rank, ``<dir>/metrics/rank<R>.jsonl`` (``<dir>``: ``--metrics-dir``,
else ``--save``; DeepSpeed configs: the ``"metrics_dir"`` key), each record ``{"kind": KIND,
"time": unix seconds, ...fields}``, appended and flushed as written, so a crash loses at most
the last line (readers skip it). Kinds and fields are listed in docs/report.md: ``run``,
``step``, ``eval``, ``checkpoint``, ``memory``, ``profile``.

The file class lives in :mod:`zerotron.fileio` (the bottom layer) and the Engine's writer in
:mod:`zerotron.engine.run_metrics`, so that the Engine, below training/, writes through the
same class; this module is their documented entry, and says what MFU means:
:data:`FLOPS_CONVENTION` and :func:`peak_flops`.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from zerotron.engine.run_metrics import RunMetrics, memory_fields
from zerotron.fileio import MetricsFile, metrics_path, read_metrics

__all__ = [
    "FLOPS_CONVENTION",
    "MetricsFile",
    "RunMetrics",
    "memory_fields",
    "metrics_path",
    "peak_flops",
    "read_metrics",
]

FLOPS_CONVENTION = (
    "model FLOPs per token 6·N + 12·L·h·s (forward + backward, recompute not counted; N = "
    "the non-embedding matrices and the LM head, the tied embedding once); MFU = tokens/s × "
    "FLOPs per token / world size / peak FLOP/s of one rank"
)

# Dense peak FLOP/s per GPU (datasheets): (16-bit tensor cores, fp32), by a name fragment.
GPU_PEAKS: tuple[tuple[str, float, float], ...] = (
    ("H200", 989e12, 67e12),
    ("H100 PCIe", 756e12, 51e12),
    ("H100 NVL", 835e12, 60e12),
    ("H100", 989e12, 67e12),
    ("A100", 312e12, 19.5e12),
    ("A10G", 70e12, 31.2e12),
    ("L4", 121e12, 30.3e12),
    ("V100", 125e12, 15.7e12),
)


def peak_flops(device: torch.device, dtype: str, given_tflops: float | None = None):
    """``(peak FLOP/s of one rank, how it was found)`` for MFU, or ``(None, why not)``.

    ``given_tflops`` (``--peak-tflops``) wins; a CUDA device is looked up in
    :data:`GPU_PEAKS` (16-bit: the tensor-core peak, fp32: the plain fp32 peak); on CPU a
    short probe measures the best ``torch.mm`` rate of this rank's threads on a 1024³ fp32
    product (a measured ceiling, not a datasheet number).
    """
    if given_tflops:
        return given_tflops * 1e12, f"--peak-tflops {given_tflops:g}"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for fragment, half, single in GPU_PEAKS:
            if fragment in name:
                peak = single if dtype == "fp32" else half
                return peak, f"{name} datasheet dense {dtype} peak {peak / 1e12:g} TFLOP/s"
        return None, f"{name}: no peak known (pass --peak-tflops)"
    return _cpu_probe()


def _cpu_probe(n: int = 1024, budget_s: float = 0.15) -> tuple[float, str]:
    # A generator of its own: the run's global RNG stream (dropout, resumed exactly) is untouched.
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
    torch.mm(a, b)  # warm the kernel
    best, spent = 0.0, 0.0
    while spent < budget_s:
        t0 = time.perf_counter()
        torch.mm(a, b)
        dt = time.perf_counter() - t0
        spent += dt
        best = max(best, 2.0 * n**3 / max(dt, 1e-9))
    threads = torch.get_num_threads()
    how = f"CPU: best torch.mm fp32 {n}³ rate on {threads} thread(s), measured at start"
    return best, how


def for_pretrain(cfg: Any, rank: int, device: torch.device, flops_per_token: float) -> Any:
    """``zerotron pretrain``'s writer: into ``--metrics-dir``, else ``--save``; None if neither.

    The training loop writes the step records (at each log interval), so the Engine's own
    per-step records are off."""
    directory = cfg.training.metrics_dir or cfg.checkpoint.save
    if not directory:
        return None
    peak, how = peak_flops(device, cfg.precision.params_dtype, cfg.training.peak_tflops)
    return RunMetrics(
        directory,
        rank=rank,
        # the resolved values (batch geometry, dtypes...), every section
        config={
            name: getattr(cfg, name).model_dump(mode="json") for name in type(cfg).model_fields
        },
        peak_flops=peak,
        flops_convention=f"{FLOPS_CONVENTION}; peak: {how}",
        flops_per_token=flops_per_token,
        tokens_per_sample=cfg.model.seq_length,
        steps_from_engine=False,
    )
