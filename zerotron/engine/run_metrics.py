"""What an Engine writes into the run's metrics file (``zerotron report`` reads it).

:class:`RunMetrics` is one rank's writer over a :class:`~zerotron.fileio.MetricsFile`
(``<dir>/metrics/rank<R>.jsonl``; the format is documented in :mod:`zerotron.training.metrics`
and docs/report.md). :func:`attach` gives it to an Engine; from then on

- the first record after the Engine starts, or after each :meth:`Engine.load_checkpoint`, is
  preceded by a ``run`` record (config, layout, host, the iteration it starts from): one per
  start, restart or resume, written lazily so a run that resumes says where it resumed;
- every ``save_checkpoint`` writes a ``checkpoint`` record (iteration, path), every rank;
- with ``steps_from_engine`` (DeepSpeed-style scripts) every optimizer step writes a ``step``
  record: the Engine's monitor events (the step's mean micro-batch loss on this rank, lr, loss
  scale) plus skipped, grad norm, step time, samples/s (tokens/s and MFU when
  ``tokens_per_sample`` / ``flops_per_token`` and ``peak_flops`` are set) and memory.
  ``zerotron pretrain`` turns it off and writes its own, richer step records at each log
  interval (:mod:`zerotron.training.loop`).

It lives in ``engine/`` because DeepSpeed scripts have no training loop of zerotron's: the
Engine is what they call. The DeepSpeed config key is ``"metrics_dir": DIR`` (zerotron's own).
"""

from __future__ import annotations

import math
import os
import socket
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from zerotron.distributed.state import state
from zerotron.fileio import MetricsFile, metrics_path

ATTRIBUTE = "_run_metrics"


def memory_fields(device: torch.device) -> dict[str, int]:
    """This process's memory now: the CUDA allocator's counters, or resident memory on CPU."""
    if device.type == "cuda":
        return {
            "cuda_allocated_bytes": torch.cuda.memory_allocated(device),
            "cuda_reserved_bytes": torch.cuda.memory_reserved(device),
            "cuda_max_allocated_bytes": torch.cuda.max_memory_allocated(device),
        }
    import psutil

    return {"rss_bytes": psutil.Process(os.getpid()).memory_info().rss}


def finite(value: Any) -> float | None:
    """``value`` as a float, or None when there is none (JSON has no NaN for browsers)."""
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


class RunMetrics:
    """One rank's metrics-file writer (see the module docstring)."""

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        rank: int,
        config: Mapping[str, Any] | None = None,
        peak_flops: float | None = None,
        flops_convention: str = "",
        flops_per_token: float | None = None,
        tokens_per_sample: int | None = None,
        steps_from_engine: bool = True,
    ) -> None:
        self.directory = Path(directory)
        self.rank = rank
        self.file = MetricsFile(metrics_path(directory, rank))
        self.config = dict(config or {})
        self.peak_flops = peak_flops
        self.flops_convention = flops_convention
        self.flops_per_token = flops_per_token
        self.tokens_per_sample = tokens_per_sample
        self.steps_from_engine = steps_from_engine
        self.layout: dict[str, Any] = {}
        self._run_pending: dict[str, Any] | None = {"iteration": 0}
        self._engine: Any = None
        self._last_step_at: float | None = None

    # ---- records

    def start(self, iteration: int, **fields: Any) -> None:
        """A (re)start at ``iteration``: the next record is preceded by a ``run`` record."""
        self._run_pending = {"iteration": int(iteration), **fields}
        self._last_step_at = time.perf_counter()  # the first step's time counts from here

    def write(self, kind: str, **fields: Any) -> None:
        """One record (after the pending ``run`` record, if any)."""
        if self._run_pending is not None:
            pending, self._run_pending = self._run_pending, None
            self.file.write(
                "run",
                config=self.config,
                layout=self.layout,
                rank=self.rank,
                host=socket.gethostname(),
                pid=os.getpid(),
                peak_flops=self.peak_flops,
                flops_convention=self.flops_convention,
                **pending,
            )
        self.file.write(kind, **fields)

    def close(self) -> None:
        self.file.close()

    # ---- the Engine's step, as a monitor writer (MonitorMaster calls these)

    def write_events(self, events: Sequence[tuple[str, float, int]]) -> None:
        engine = self._engine
        if engine is None or not self.steps_from_engine:
            return
        values = {name.rsplit("/", 1)[-1]: value for name, value, _ in events}
        now = time.perf_counter()
        seconds = now - self._last_step_at if self._last_step_at is not None else None
        samples = engine.train_batch_size()
        fields: dict[str, Any] = {
            "iteration": engine.global_steps,
            "loss": finite(values.get("train_loss")),
            "lr": finite(values.get("lr")),
            "loss_scale": finite(engine.cur_scale),
            "skipped": not engine.was_step_applied(),
            "grad_norm": finite(engine.get_global_grad_norm()),
            "step_time_s": seconds,
            "samples_per_s": samples / seconds if seconds else None,
        }
        if seconds and self.tokens_per_sample:
            tokens_per_s = samples * self.tokens_per_sample / seconds
            fields["tokens_per_s"] = tokens_per_s
            if self.flops_per_token and self.peak_flops:
                # per rank: the step's model FLOPs are shared by every rank of the world
                world = max(self.layout.get("world_size", 1), 1)
                fields["mfu"] = tokens_per_s * self.flops_per_token / world / self.peak_flops
        self.write("step", **fields, **memory_fields(engine.device))
        self._last_step_at = time.perf_counter()


def attach(engine: Any, metrics: RunMetrics | None) -> None:
    """Give ``engine`` its metrics writer (None: none); see the module docstring."""
    setattr(engine, ATTRIBUTE, metrics)
    if metrics is None:
        return
    ps = state()
    metrics._engine = engine
    metrics.layout = {
        "tp": ps.tp_size,
        "pp": ps.pp_size,
        "dp": ps.dp_size,
        "vpp": getattr(engine.pipeline, "num_chunks", None) or 1,
        "zero_stage": engine.zero_optimization_stage(),
        "world_size": ps.world_size,
    }
    metrics.start(engine.global_steps)
    if metrics.steps_from_engine:
        engine.monitor.writers.append(metrics)  # closed with the monitors (engine.destroy())


def of(engine: Any) -> RunMetrics | None:
    """``engine``'s metrics writer, or None."""
    return getattr(engine, ATTRIBUTE, None)


def saved(engine: Any, path: str | os.PathLike) -> None:
    """After ``save_checkpoint``: a ``checkpoint`` record."""
    metrics = of(engine)
    if metrics is not None:
        metrics.write("checkpoint", iteration=engine.global_steps, path=str(path))


def loaded(engine: Any, path: str | os.PathLike) -> None:
    """After ``load_checkpoint``: the next record is a ``run`` record at the loaded iteration."""
    metrics = of(engine)
    if metrics is not None:
        metrics.start(engine.global_steps, resumed_from=str(path))


def from_config(
    cfg: Any, rank: int, config: Mapping[str, Any] | None = None, **options: Any
) -> RunMetrics | None:
    """The writer a Config asks for (``training.metrics_dir``; DeepSpeed's ``"metrics_dir"``
    key), recording ``config`` (default: the Config's dict); None when it asks for none."""
    directory = cfg.training.metrics_dir
    if not directory:
        return None
    return RunMetrics(
        directory,
        rank=rank,
        config=config if config is not None else cfg.to_dict(),
        **options,
    )
