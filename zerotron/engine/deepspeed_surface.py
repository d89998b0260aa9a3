"""What DeepSpeed's engine offers beyond training: the Engine's DeepSpeed-facing surface.

:class:`DeepSpeedSurface` is a mixin of :class:`~zerotron.engine.core.Engine` (the core keeps
the training mechanics; this module answers the questions scripts, Hugging Face's Trainer and
accelerate ask a ``DeepSpeedEngine``). As in DeepSpeed, the Engine is an ``nn.Module`` with the
model registered as ``self.module``, so

- ``engine.parameters()``, ``named_parameters()`` (names ``module.<name>``),
  ``named_modules()``, ``state_dict()`` (keys ``module.<name>``), ``train()``/``eval()``,
  ``to()``, ``zero_grad()`` and forward hooks are ``nn.Module``'s over that one child;
- any other attribute the Engine lacks is the module's (``engine.generate``,
  ``engine.some_layer``): ``__getattr__`` falls through to ``self.module``.

Plus DeepSpeed's names: ranks and sizes (``local_rank``, ``global_rank``, ``world_size``,
``dp_world_size``, ``mp_world_size``, ``device``), the config questions (``fp16_enabled()``,
``bfloat16_enabled()``, ``gradient_clipping()``, ``zero_optimization*()``,
``zero_offload_*()``), step results (``was_step_applied()``, ``get_global_grad_norm()``,
``get_lr()``, ``get_mom()``, ``skipped_steps``, ``cur_scale``), the accumulation boundary
(``is_gradient_accumulation_boundary()``, ``set_gradient_accumulation_boundary()``),
``scale(loss)``, ``tput_timer``, 16-bit saving and the default training data iterator.

DeepSpeed has no ``register_post_step_hook`` (that name is SageMaker model parallel's); the
Engine has none either.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from zerotron.checkpoint.layout import GATHERED_16BIT_FILE
from zerotron.distributed.init import get_world_size
from zerotron.distributed.init import local_rank as node_local_rank
from zerotron.distributed.state import state
from zerotron.engine import checkpoint_io
from zerotron.engine.timers import ThroughputTimer
from zerotron.errors import ConfigError, UnsupportedError

if TYPE_CHECKING:
    from zerotron.engine.protocols import DataParallelPart, OptimizerPart, PipelinePart
    from zerotron.precision.step import StepResult

# Attributes that hold modules without being submodules: registering them would put their
# weights in engine.state_dict() twice (the compiled module, a loss module).
_UNREGISTERED = frozenset({"_forward", "loss_fn"})


class DeepSpeedSurface:
    """DeepSpeed's engine surface of :class:`~zerotron.engine.core.Engine` (module docstring)."""

    # set by the Engine
    module: nn.Module
    optimizer: Any
    optimizer_part: OptimizerPart
    data_parallel: DataParallelPart | None
    pipeline: PipelinePart | None
    lr_scheduler: Any
    device: torch.device
    data_parallel_size: int
    _steps_per_print: int | None
    micro_steps: int
    global_steps: int
    last_step: StepResult | None
    _gas: int
    _micro_batch_size: int
    _wall_clock_breakdown: bool

    # ---- the model as a child module --------------------------------------------------------

    def _set_module(self, model: nn.Module) -> None:
        """Register ``model`` as the child ``module`` (DeepSpeed's ``_set_client_model``), also
        in ``__dict__`` so that reading ``self.module`` is a plain attribute lookup."""
        self._modules["module"] = model  # type: ignore[attr-defined]
        self.__dict__["module"] = model
        first = next((p for p in model.parameters() if p.is_floating_point()), None)
        self._param_dtype = first.dtype if first is not None else torch.float32

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _UNREGISTERED:
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    def __getattr__(self, name: str) -> Any:
        """nn.Module's parameters, buffers and children, then the module's attributes."""
        try:
            return super().__getattr__(name)  # type: ignore[misc]
        except AttributeError:
            pass
        module = self.__dict__.get("_modules", {}).get("module")
        missing = f"'{type(self).__name__}' object has no attribute '{name}'"
        if module is None or name.startswith("__"):
            raise AttributeError(missing)
        try:
            return getattr(module, name)
        except AttributeError as e:
            from zerotron.config.deepspeed_refused import missing_attribute

            message = f"{missing} (nor has its module: {e})"
            raise missing_attribute("deepspeed.DeepSpeedEngine", name, message) from e

    def train(self, mode: bool = True) -> Any:
        nn.Module.train(self, mode)  # type: ignore[arg-type]
        return self

    def eval(self) -> Any:
        return self.train(False)

    def _init_deepspeed_surface(self) -> None:
        self._step_applied = False
        self._micro_base = 0  # micro_steps when the accumulation size last changed
        self._boundary_override: bool | None = None
        self._micro_boundary = False
        self._backward_since_step = False
        self._running_engine_backward = False
        self._output_backward_open = False
        self._loss_scaled_by_user = False
        self.data_iterator: Iterator[Any] | None = None
        self.training_dataloader: Any = None
        self.load_universal = False
        """``load_checkpoint`` reads DeepSpeed universal checkpoints (the DeepSpeed config's
        ``checkpoint.load_universal``; :func:`.deepspeed_checkpoint.deepspeed_tag_dir`)."""
        self._pipe_elapsed = 0.0
        self.tput_timer = ThroughputTimer(
            self.train_batch_size(), steps_per_output=self._steps_per_print
        )

    # ---- sizes and ranks ------------------------------------------------------------------------

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self._gas

    def train_batch_size(self) -> int:
        return self._micro_batch_size * self._gas * self.data_parallel_size

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Train on ``train_batch_size`` samples a step from the next step on, by changing the
        gradient accumulation steps (the micro-batch size stays; DeepSpeed's). Call it between
        optimizer steps, on every rank."""
        unit = self._micro_batch_size * self.data_parallel_size
        if train_batch_size < 1 or train_batch_size % unit:
            raise ConfigError(
                f"train batch size {train_batch_size} is not a positive multiple of "
                f"train_micro_batch_size_per_gpu {self._micro_batch_size} × data-parallel size "
                f"{self.data_parallel_size} = {unit}",
                where="set_train_batch_size",
                fix=f"use a multiple of {unit}",
            )
        self._resize(gas=train_batch_size // unit, micro=self._micro_batch_size)

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """Run micro-batches of ``micro_batch_size`` samples from the next step on, keeping the
        gradient accumulation steps (so the train batch size changes; DeepSpeed's)."""
        if micro_batch_size < 1:
            raise ConfigError(
                f"micro batch size must be positive, got {micro_batch_size}",
                where="set_train_micro_batch_size",
            )
        self._resize(gas=self._gas, micro=micro_batch_size)

    def _resize(self, gas: int, micro: int) -> None:
        done = self._micro_in_accumulation()
        if done or self._backward_since_step:
            raise ConfigError(
                "the batch size cannot change in the middle of a gradient accumulation "
                f"({done} of {self._gas} micro-batches done)",
                where="set_train_batch_size",
                fix="change it after engine.step() ended an accumulation",
            )
        self._micro_base = self.micro_steps  # accumulations of the new size count from here
        resized = micro != self._micro_batch_size
        self._gas, self._micro_batch_size = gas, micro
        if self.pipeline is not None:
            self.pipeline.set_num_microbatches(gas, shapes_change=resized)
        self.tput_timer.batch_size = self.train_batch_size()

    @property
    def local_rank(self) -> int:
        """This process's index on its node (the launcher's ``LOCAL_RANK``; 0 without one)."""
        return node_local_rank()

    @property
    def global_rank(self) -> int:
        return state().rank

    @property
    def world_size(self) -> int:
        return get_world_size()

    @property
    def dp_world_size(self) -> int:
        return self.data_parallel_size

    @property
    def mp_world_size(self) -> int:
        """Tensor-parallel ranks per replica (DeepSpeed's ``mpu.get_model_parallel_world_size``:
        Megatron's model parallelism, which the pipeline does not count)."""
        return state().tp_size

    # ---- configuration questions ----------------------------------------------------------------

    def fp16_enabled(self) -> bool:
        return self._param_dtype == torch.float16

    def bfloat16_enabled(self) -> bool:
        return self._param_dtype == torch.bfloat16

    def gradient_clipping(self) -> float:
        return float(getattr(self.optimizer, "clip_grad", 0.0))

    def zero_optimization_stage(self) -> int:
        """The ZeRO stage of the optimizer (0: none)."""
        return self.optimizer_part.zero_stage

    def zero_optimization(self) -> bool:
        return self.zero_optimization_stage() > 0

    def zero_optimization_partition_gradients(self) -> bool:
        return self.zero_optimization_stage() >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self.zero_optimization_stage() == 3

    def _zero_option(self, name: str) -> Any:
        options = getattr(self.optimizer, "options", None)
        return getattr(options, name, None) if options is not None else None

    def zero_offload_optimizer(self) -> Any:
        """The ``offload_optimizer`` options (device, nvme_path, ...) when it is on, else None."""
        offload = self._zero_option("offload_optimizer")
        return offload if offload is not None and offload.enabled else None

    def zero_offload_param(self) -> Any:
        """The ``offload_param`` options when it is on (stage 3 only), else None."""
        offload = self._zero_option("offload_param")
        return offload if offload is not None and offload.enabled else None

    def zero_cpu_offload(self) -> bool:
        offload = self.zero_offload_optimizer()
        return offload is not None and offload.device == "cpu"

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """Stage 3: whether ``save_16bit_model`` (and checkpoints) gather the whole model."""
        return bool(self._zero_option("gather_16bit_weights_on_model_save"))

    def wall_clock_breakdown(self) -> bool:
        return self._wall_clock_breakdown

    def load_universal_checkpoint(self) -> bool:
        """Whether ``load_checkpoint`` reads universal checkpoints (checkpoint.load_universal)."""
        return self.load_universal

    def steps_per_print(self) -> int | None:
        """How often progress is printed (DeepSpeed's ``steps_per_print``; None: never)."""
        return self._steps_per_print

    # ---- step results -------------------------------------------------------------------------

    @property
    def skipped_steps(self) -> int:
        return self.optimizer_part.num_skipped_steps

    @property
    def cur_scale(self) -> float:
        return self.optimizer_part.loss_scale

    loss_scale = cur_scale

    def _optimizer_param(self, name: str) -> list[Any]:
        return [group.get(name, 0.0) for group in self.optimizer_part.param_groups]

    def get_lr(self) -> list[float]:
        return self._optimizer_param("lr")

    def get_mom(self) -> list[Any]:
        """Per parameter group: ``momentum`` (SGD, RMSprop), else ``betas`` (Adam's kind)."""
        groups = self.optimizer_part.param_groups
        if groups and "betas" not in groups[0] and "momentum" in groups[0]:
            return self._optimizer_param("momentum")
        return self._optimizer_param("betas")

    def was_step_applied(self) -> bool:
        """Whether the last ``step()`` call updated the parameters (False between
        accumulation boundaries and for a step skipped on overflow)."""
        return self._step_applied

    def get_global_grad_norm(self) -> float | None:
        """The gradient norm (before clipping, over every rank) of the last optimizer step;
        None before the first and after a step skipped on overflow."""
        return self.last_step.grad_norm if self.last_step is not None else None

    # ---- the accumulation boundary and the backward rules -------------------------------------

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-batch ends an accumulation: the one whose backward ran
        since the last ``step()``, else the next one (or what
        :meth:`set_gradient_accumulation_boundary` said)."""
        if self._boundary_override is not None:
            return self._boundary_override
        if self._backward_since_step:
            return self._micro_in_accumulation() == 0
        return (self._micro_in_accumulation() + 1) % self._gas == 0

    def _next_backward_is_boundary(self) -> bool:
        if self._boundary_override is not None:
            return self._boundary_override
        return (self._micro_in_accumulation() + 1) % self._gas == 0

    def _micro_in_accumulation(self) -> int:
        """Micro-batches done in the current accumulation (since the last resize, the counts
        are of the new size)."""
        return (self.micro_steps - self._micro_base) % self._gas

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Override the micro-step count: the next backwards reduce (and ``step()`` steps) as
        ``is_boundary`` says, until it is set again (DeepSpeed's)."""
        self._boundary_override = bool(is_boundary)

    def scale(self, loss: Tensor) -> Tensor:
        """``loss`` times the loss scale (1 without fp16), for ``engine.scale(loss).backward()``:
        the Engine then divides by the accumulation steps only."""
        self._loss_scaled_by_user = True
        return self.optimizer_part.scale_loss(loss)

    def _output_grad_factor(self) -> float:
        if self._running_engine_backward:
            return 1.0
        scale = 1.0 if self._loss_scaled_by_user else float(self.optimizer_part.loss_scale)
        return scale / self._gas

    def _begin_output_backward(self) -> bool:
        if self._running_engine_backward or self._output_backward_open:
            return False
        self._output_backward_open = True
        self._begin_micro_batch()  # type: ignore[attr-defined]
        return True

    def _end_output_backward(self) -> None:
        self._output_backward_open = False
        self._loss_scaled_by_user = False
        self._end_micro_batch()  # type: ignore[attr-defined]

    # ---- training data --------------------------------------------------------------------------

    def set_dataloader(self, loader: Any) -> None:
        """``train_batch()`` without ``data_iter`` draws from ``loader`` from now on."""
        self.training_dataloader = loader
        self.data_iterator = iter(loader)

    def set_dataiterator(self, iterator: Iterator[Any]) -> None:
        """``train_batch()`` without ``data_iter`` draws from ``iterator`` from now on."""
        self.training_dataloader = None
        self.data_iterator = iterator

    def _data_iter(self, data_iter: Iterator[Any] | None) -> Iterator[Any]:
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        if self.data_iterator is None:
            raise ConfigError(
                "train_batch() without data_iter, and no training data",
                where="Engine.train_batch",
                fix="pass engine.train_batch(data_iter), or initialize(training_data=dataset)",
            )
        return self.data_iterator

    # ---- DeepSpeed's pipeline progress line ---------------------------------------------------

    def _pipe_batch_timer(self) -> float:
        return time.perf_counter()

    def _print_pipeline_progress(self, loss: Tensor, started: float) -> None:
        """``steps: N loss: X iter time (s): T samples/sec: S`` on rank 0 every
        ``steps_per_print`` steps (DeepSpeed's PipelineEngine), T averaged since the last."""
        self._pipe_elapsed += time.perf_counter() - started
        every = self._steps_per_print
        if not every or self.global_steps % every:
            return
        iter_time = self._pipe_elapsed / every
        self._pipe_elapsed = 0.0
        if self.global_rank == 0:
            tput = self.train_batch_size() / iter_time if iter_time > 0 else float("inf")
            print(
                f"steps: {self.global_steps} loss: {float(loss):0.4f} "
                f"iter time (s): {iter_time:0.3f} samples/sec: {tput:0.3f}",
                flush=True,
            )

    # ---- whole and 16-bit weights ---------------------------------------------------------------

    def module_state_dict(
        self, rank0_only: bool = False, exclude_frozen_parameters: bool = False
    ) -> dict[str, Any] | None:
        """The module's full state dict; under ZeRO stage 3 gathered (a collective), kept on
        data-parallel rank 0 only with ``rank0_only`` (others get None)."""
        weights = self.optimizer_part.module_state_dict(self.module, rank0_only)
        if weights is not None and exclude_frozen_parameters:
            weights = checkpoint_io.without_frozen(self.module, weights)
        return weights

    def _zero3_consolidated_16bit_state_dict(
        self, exclude_frozen_parameters: bool = False
    ) -> dict[str, Any] | None:
        """The whole 16-bit state dict gathered from the stage-3 partitions onto global rank 0
        (None elsewhere); every rank calls it."""
        if not self.zero_optimization_partition_weights():
            raise UnsupportedError(
                "_zero3_consolidated_16bit_state_dict needs ZeRO stage 3",
                where="Engine",
                fix="use engine.module.state_dict(): below stage 3 every rank holds the weights",
            )
        weights = self.module_state_dict(True, exclude_frozen_parameters)
        return weights if self.global_rank == 0 else None

    def save_16bit_model(
        self,
        save_dir: str | Path,
        save_filename: str = GATHERED_16BIT_FILE,
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """The module's (gathered) state dict to ``save_dir/save_filename``; every rank calls
        it. False, saving nothing, at stage 3 without ``gather_16bit_weights_on_model_save``
        (the partitions alone are no model), else True (DeepSpeed's)."""
        if (
            self.zero_optimization_partition_weights()
            and not self.zero_gather_16bit_weights_on_model_save()
        ):
            if self.global_rank == 0:
                print(
                    f"Did not save the model {Path(save_dir) / save_filename} because "
                    "stage3_gather_16bit_weights_on_model_save is False",
                    flush=True,
                )
            return False
        checkpoint_io.save_16bit_model(self, save_dir, save_filename, exclude_frozen_parameters)
        return True

    save_fp16_model = save_16bit_model

    def destroy(self) -> None:
        """Close the monitors (flushing their files); the engine can still train, unmonitored."""
        self.monitor.close()  # type: ignore[attr-defined]
