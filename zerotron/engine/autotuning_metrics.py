"""An autotuning experiment measuring itself, as DeepSpeed's engine does when the config's
``autotuning`` block is enabled.

The tuner (:mod:`zerotron.tuning.tune`) writes each experiment's config with
``autotuning.enabled`` and a ``metric_path``. The Engine then, after every optimizer step,
calls :func:`after_step`: the steps after ``start_profile_step`` up to ``end_profile_step``
are timed on the wall clock (whole steps: data, forward, backward, reduction, optimizer), rank
0 writes the metric JSON and every rank ends the run (``SystemExit(0)``), as DeepSpeed's
``_autotuning_exit`` does. The JSON has DeepSpeed's keys::

    {"latency": ms per step, "throughput": samples per second (the global batch),
     "FLOPS_per_gpu": model FLOP/s of one rank, "flops": the same, "steps": measured steps}

(DeepSpeed divides its ``train_batch_size * 1e6`` by milliseconds; zerotron's throughput is
samples per second. FLOPs are the forward's, counted once on the warm-up step before the
measured ones by :func:`zerotron.engine.flops_profiler.flop_counter` (torch's FlopCounterMode,
taught zerotron's CPU GEMMs and attention) —
times 3 for the backward, as DeepSpeed's profiler does.)

With ``model_info.profile`` the run is DeepSpeed's model-info profiling run instead: the first
forward's activation memory (device bytes allocated across it; the process's resident memory
on CPU) and the parameter count go to ``model_info_path`` and the run ends.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch
from torch import nn

from zerotron.config.sections import AutotuningConfig
from zerotron.distributed import comm
from zerotron.distributed.state import is_model_parallel_initialized, state
from zerotron.engine.flops_profiler import flop_counter
from zerotron.fileio import atomic_write_text


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _memory_now() -> int:
    """Bytes the process holds for tensors: the device allocator's, or resident memory on CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.memory_allocated()
    import psutil

    return psutil.Process().memory_info().rss


class AutotuningProbe:
    """The measurement of one autotuning experiment (see the module docstring)."""

    def __init__(self, options: AutotuningConfig, module: nn.Module):
        self.start = options.autotuning_start_profile_step
        self.end = options.autotuning_end_profile_step
        self.metric_path = options.autotuning_metric_path or os.path.join(
            os.getcwd(), "autotuning_metric.json"
        )
        self.model_info_path = options.autotuning_model_info_path or os.path.join(
            os.getcwd(), "autotuning_model_info.json"
        )
        self.profile_model = options.autotuning_model_info_profile
        self.t_start: float | None = None
        self.forward_flops: int | None = None
        self._counter: Any = None
        self._counted_step = max(self.start - 1, 0)  # the warm-up step whose FLOPs are counted
        self._memory_before = 0
        self._hooks = [
            module.register_forward_pre_hook(self._before_forward),
            module.register_forward_hook(self._after_forward),
        ]
        self._module = module
        self.global_steps = 0

    # ---- forward hooks: FLOPs on one step, or the model-info profile

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        if self.profile_model:
            self._memory_before = _memory_now()
        elif self.global_steps == self._counted_step and self._counter is None:
            try:
                self._counter = flop_counter()
                self._counter.__enter__()
            except Exception:  # FLOPs are a bonus: a model the counter cannot trace still runs
                self._counter = None

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.profile_model:
            self._write_model_info(_memory_now() - self._memory_before)
            raise SystemExit(0)
        if self._counter is not None:
            counter, self._counter = self._counter, None
            counter.__exit__(None, None, None)
            self.forward_flops = (self.forward_flops or 0) + int(counter.get_total_flops())

    def _write_model_info(self, activation_bytes: int) -> None:
        own = sum(int(getattr(p, "ds_numel", p.numel())) for p in self._module.parameters())
        trainable = sum(
            int(getattr(p, "ds_numel", p.numel()))
            for p in self._module.parameters()
            if p.requires_grad
        )
        counts = torch.tensor([own, trainable], dtype=torch.float64)
        dist = torch.distributed
        world = 1
        if dist.is_available() and dist.is_initialized():
            world = dist.get_world_size()
            # through comm: a CPU tensor travels through the GPU on an nccl group
            comm.all_reduce(counts, comm.world_group())
        # every data-parallel replica holds the same model
        replicas = state().dp_size if is_model_parallel_initialized() else world
        info = {
            "num_params": int(counts[0].item() / replicas),
            "trainable_num_params": int(counts[1].item() / replicas),
            "activation_mem_per_gpu": max(int(activation_bytes), 0),
            "world_size": world,
            "rank": _rank(),
        }
        if _rank() == 0:
            _write_json(self.model_info_path, info)

    # ---- the step counter

    def after_step(self, engine: Any) -> None:
        """Called by the Engine after each optimizer step (``engine.global_steps`` counted)."""
        self.global_steps = engine.global_steps
        if self.global_steps == self.start:
            self.t_start = time.perf_counter()
        if self.global_steps < self.end or self.t_start is None:
            return
        steps = self.end - self.start
        seconds = (time.perf_counter() - self.t_start) / steps
        samples = engine.train_batch_size()
        flops = None
        if self.forward_flops is not None:
            per_step = 3 * self.forward_flops  # forward + backward (twice the forward)
            flops = per_step / seconds
        metrics = {
            "latency": seconds * 1000.0,
            "throughput": samples / seconds,
            "FLOPS_per_gpu": flops,
            "flops": flops,
            "steps": steps,
            "train_batch_size": samples,
            "micro_batch_size": engine.train_micro_batch_size_per_gpu(),
            "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
        }
        if _rank() == 0:
            _write_json(self.metric_path, metrics)
            print(f"autotuning: wrote metrics to {self.metric_path}", flush=True)
        for hook in self._hooks:
            hook.remove()
        raise SystemExit(0)  # DeepSpeed's experiment ends here, on every rank


def _write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write_text(path, json.dumps(data, indent=2) + "\n")


def attach(engine: nn.Module, options: AutotuningConfig | None) -> None:
    """Give ``engine`` a probe when ``options`` enable autotuning (else nothing happens)."""
    if options is not None and options.autotuning_enabled:
        engine._autotuning_probe = AutotuningProbe(options, engine.module)


def after_step(engine: Any) -> None:
    """The Engine's one-line hook after an optimizer step."""
    probe = getattr(engine, "_autotuning_probe", None)
    if probe is not None:
        probe.after_step(engine)
