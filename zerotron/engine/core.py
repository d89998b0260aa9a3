"""The Engine: the one object a training loop talks to.

It gives DeepSpeed's engine API — ``engine(batch)``, ``backward(loss)``, ``step()``,
``train_batch()``, ``eval_batch()``, ``save_checkpoint()``, ``load_checkpoint()`` — to parts it
calls through small protocols (:mod:`zerotron.engine.protocols`), never asking which kind it
holds; the loop never touches loss scales, master weights or gradients:

- the optimizer part (:mod:`zerotron.engine.optimizers`) over a MixedPrecisionOptimizer or a
  ZeroOptimizer: one step / state interface; it answers who reduces gradients and how its
  state is saved and loaded;
- data parallelism (DataParallel, or the ZeroOptimizer itself): told which micro-batch ends an
  accumulation (only that backward reduces), waited for before the optimizer step;
- pipeline parallelism (a PipelineRuntime over this rank's chunks; ``model`` is the module
  holding them, e.g. ``training.build.StageModel``): whole batches only, data-parallel
  reduction held back until the schedule is done, then the tied weights' gradients summed over
  their stages and the loss broadcast from the last stage;
- checkpoint I/O (:mod:`~zerotron.engine.checkpoint_io`, loads fitted to the model by a
  :class:`~zerotron.checkpoint.fit.StateFitter`), timers and monitors.

Like DeepSpeed's engine it is an ``nn.Module`` with the model as its child ``module``; what
DeepSpeed's engine answers beyond training (ranks, config questions, step results, attribute
fall-through to the model, 16-bit saving) is the :class:`~zerotron.engine.deepspeed_surface.
DeepSpeedSurface` mixin, and ``loss.backward()`` on its outputs works as ``backward(loss)``
(:mod:`~zerotron.engine.output_grads`).

Engines are assembled in one place, :mod:`zerotron.engine.builder`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from zerotron.checkpoint.fit import StateFitter
from zerotron.checkpoint.in_memory import InMemoryCheckpoint
from zerotron.distributed import comm
from zerotron.distributed.init import get_world_size
from zerotron.distributed.state import state
from zerotron.engine import autotuning_metrics, checkpoint_io, flops_profiler
from zerotron.engine.deepspeed_surface import DeepSpeedSurface
from zerotron.engine.monitors import MonitorMaster, training_events
from zerotron.engine.optimizers import optimizer_part
from zerotron.engine.output_grads import wrap_outputs
from zerotron.engine.protocols import DataParallelPart, Fitter, PipelinePart
from zerotron.engine.timers import WALL_CLOCK_TIMERS, NullTimer, NullTimers, Timers, wall_clock_line
from zerotron.errors import UnsupportedError
from zerotron.kernels import apply_process_settings
from zerotron.parallel.declarations import allreduce_tied_grads
from zerotron.pipeline import profile as step_profile
from zerotron.precision.step import StepResult

LossFn = Callable[[nn.Module, Mapping[str, Any]], Tensor]


def _module_device(model: nn.Module) -> torch.device:
    """Where the module computes: its first parameter's (or buffer's) device, else the CPU.

    Under ZeRO stage 3 a parameter's ``data`` is an empty tensor at rest, still on that device.
    """
    first = next(itertools.chain(model.parameters(), model.buffers()), None)
    return first.device if first is not None else torch.device("cpu")


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


class Engine(DeepSpeedSurface, nn.Module):
    """Trains ``model`` (registered as ``self.module``) with ``optimizer`` (a
    :class:`~zerotron.precision.mixed.MixedPrecisionOptimizer` or a
    :class:`~zerotron.zero.ZeroOptimizer`, wrapped in its part by
    :func:`~zerotron.engine.optimizers.optimizer_part`).

    Args:
        model: the module; its parameters already in the training dtype and on ``device``
            (under ZeRO stage 3: already partitioned).
        optimizer: master weights, loss scaling, clipping; a ZeroOptimizer also partitions them
            (and gradients, parameters) over its data-parallel group and is then the
            ``data_parallel`` part too (passed again or left None).
        lr_scheduler: anything with ``step(increment)``, ``state_dict()``, ``load_state_dict()``.
        loss_fn: ``loss_fn(module, batch) -> scalar loss``, used by :meth:`train_batch` and
            :meth:`eval_batch`; :meth:`__call__` just calls the module.
        micro_batch_size: samples per micro-batch on this rank.
        gradient_accumulation_steps: micro-batches per optimizer step.
        data_parallel_size: replicas; the global batch is micro × accumulation × this.
        lr_increment: what one step advances the scheduler by (Megatron counts samples: the
            global batch size); default 1.
        checkpoint_metadata: written to every checkpoint's metadata.json (model config, vocab
            sizes, tokenizer, layout), see ``checkpoint.build_metadata``.
        state_fitter: fits loaded checkpoints to the model (default
            :class:`~zerotron.checkpoint.fit.StateFitter`: exact shapes; a GPT's builder passes
            ``VocabPadding`` so that checkpoints with another vocabulary padding load).
        compile: run the module's forward through ``torch.compile``; under a pipeline, each
            of this rank's chunks is compiled in place (``nn.Module.compile``).
        timers: optional ``timers(name).start()/stop()`` (:class:`~zerotron.engine.timers.Timers`).
        data_parallel: averages gradients over the data-parallel group (built before the
            optimizer, see :mod:`zerotron.parallel.data_parallel`); None for one replica.
        pipeline: runs ``model``'s pipeline chunks (``pipeline.modules``, all of them
            ``model``'s submodules) on the schedule; ``gradient_accumulation_steps`` must equal
            its ``num_microbatches``. None without pipeline parallelism.
        wall_clock_breakdown: time forward, backward (and its gradient reduction) and step as
            DeepSpeed does (``engine.timers(name)``) and print them on rank 0 every
            ``steps_per_print`` steps.
        steps_per_print: see ``wall_clock_breakdown``; None never prints.
        device: where batches go; default the module's first parameter's device.
        monitor: writes DeepSpeed's training events at each optimizer step (see
            :meth:`step`); None or a disabled one writes nothing. :meth:`destroy` closes it.
        checkpoint_tag_validation: at :meth:`save_checkpoint` with several ranks, check that
            they all save under the same tag (DeepSpeed's ``checkpoint.tag_validation``):
            ``"Warn"`` warns naming the ranks that differ, ``"Fail"`` raises CheckpointError,
            ``"Ignore"`` skips the check (and its all-gather).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Any,
        lr_scheduler: Any = None,
        *,
        loss_fn: LossFn | None = None,
        micro_batch_size: int = 1,
        gradient_accumulation_steps: int = 1,
        data_parallel_size: int = 1,
        lr_increment: int = 1,
        checkpoint_metadata: Mapping[str, Any] | None = None,
        state_fitter: Fitter | None = None,
        compile: bool = False,
        timers: Callable[[str], Any] | None = None,
        data_parallel: DataParallelPart | None = None,
        pipeline: PipelinePart | None = None,
        wall_clock_breakdown: bool = False,
        steps_per_print: int | None = None,
        device: torch.device | str | None = None,
        monitor: MonitorMaster | None = None,
        checkpoint_tag_validation: str = "Warn",
    ):
        nn.Module.__init__(self)
        checkpoint_io.check_tag_validation(checkpoint_tag_validation)
        if pipeline is not None and pipeline.num_microbatches != gradient_accumulation_steps:
            raise UnsupportedError(
                f"the pipeline runs {pipeline.num_microbatches} micro-batches a step, but "
                f"gradient_accumulation_steps is {gradient_accumulation_steps}",
                where="Engine",
                fix="build PipelineRuntime with num_microbatches = gradient_accumulation_steps",
            )
        self.optimizer_part = optimizer_part(optimizer)
        """The optimizer as the Engine calls it (:mod:`zerotron.engine.optimizers`)."""
        data_parallel = self.optimizer_part.data_parallel(data_parallel)
        self.optimizer_part.check_pipeline(pipeline)
        self._set_module(model)
        self.pipeline = pipeline
        self.data_parallel = data_parallel
        self.optimizer = self.optimizer_part.optimizer  # None when it runs forward passes only
        self.lr_scheduler = lr_scheduler
        self.loss_fn = loss_fn
        self._micro_batch_size = micro_batch_size
        self._gas = gradient_accumulation_steps
        if data_parallel is not None and data_parallel_size == 1:
            data_parallel_size = data_parallel.group.size
        self.data_parallel_size = data_parallel_size
        self.lr_increment = lr_increment
        self.checkpoint_metadata = dict(checkpoint_metadata or {})
        self.state_fitter: Fitter = state_fitter if state_fitter is not None else StateFitter()
        self._wall_clock_breakdown = wall_clock_breakdown
        self._steps_per_print = steps_per_print
        if timers is None:
            timers = Timers() if wall_clock_breakdown else NullTimers()
        self.timers = timers
        self.device = torch.device(device) if device is not None else _module_device(model)
        apply_process_settings(self.device, get_world_size())  # e.g. glibc's kept heap (CPU)
        # Compile the call, not the module: state-dict keys and parameters stay the module's.
        # Under a pipeline the runtime calls the chunks: each is compiled in place instead.
        self._forward = torch.compile(model) if compile and pipeline is None else model
        if compile and pipeline is not None:
            for chunk in pipeline.modules:
                chunk.compile()

        self._sp_params = [p for p in model.parameters() if getattr(p, "sequence_parallel", False)]
        self.repartition_zero_checkpoints = True
        """Load a ZeRO checkpoint saved with another data-parallel size by re-partitioning its
        masters and optimizer state (False: refuse, naming zero-to-fp32)."""
        self.micro_steps = 0
        self.global_steps = 0
        self.global_samples = 0
        self.last_step: StepResult | None = None
        self.monitor = monitor if monitor is not None else MonitorMaster()
        self.checkpoint_tag_validation = checkpoint_tag_validation
        self._monitor_losses: list[Tensor] = []  # this step's micro-batch losses, when monitored
        self._init_deepspeed_surface()

    # ---- one micro-batch at a time (DeepSpeed's loop) ---------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward (``engine(batch)``); returned tensors carry the Engine's
        backward rules, so ``loss.backward()`` equals ``engine.backward(loss)``
        (:mod:`zerotron.engine.output_grads`)."""
        self._refuse_under_pipeline("engine(batch)")
        self.tput_timer.start()
        with self._timed("forward", self._wall_clock_breakdown):
            out = self._forward(*args, **kwargs)
        return wrap_outputs(self, out) if torch.is_grad_enabled() else out

    @contextmanager
    def _timed(self, name: str, on: bool = True) -> Iterator[None]:
        """The block timed by ``self.timers(name)`` when ``on``."""
        timer = self.timers(name) if on else NullTimer()
        span = step_profile.phase(self, name)  # --profile-steps: None unless recording
        timer.start()
        try:
            yield
        finally:
            timer.stop()
            step_profile.end_phase(span)

    def _refuse_under_pipeline(self, what: str) -> None:
        if self.pipeline is not None:
            raise UnsupportedError(
                f"{what} under pipeline parallelism: a stage sees no whole model",
                where="Engine",
                fix="use engine.train_batch(data_iter) / engine.eval_batch(data_iter)",
            )

    def backward(
        self, loss: Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True
    ) -> Tensor:
        """Backward of one micro-batch's loss: divided by the accumulation steps (unless
        ``scale_wrt_gas`` is False), then scaled; returns the divided loss (DeepSpeed's).

        Gradients are reduced over the data-parallel ranks as in DeepSpeed: plain data
        parallelism and ZeRO stage 1 on the micro-batch that ends an accumulation only (its
        buckets overlap with its backward); ZeRO stages 2/3 on every micro-batch, each bucket
        reduce-scattered into the gradient partitions as soon as it is in. At the boundary this
        call returns once everything is reduced.
        """
        self._refuse_under_pipeline("engine.backward(loss)")
        if self.monitor.enabled:
            self._monitor_losses.append(loss.detach())
        if self._gas > 1 and scale_wrt_gas:
            loss = loss / self._gas
        with self._timed("backward", self._wall_clock_breakdown):
            self._running_engine_backward = True  # the outputs' identities leave it alone
            try:
                self._begin_micro_batch()
                self.optimizer_part.scale_loss(loss).backward(retain_graph=retain_graph)
                self._end_micro_batch()
            finally:
                self._running_engine_backward = False
        return loss

    def _begin_micro_batch(self) -> None:
        """Before a micro-batch's backward: tell data parallelism whether it ends the
        accumulation (then its backward reduces)."""
        self._micro_boundary = self._next_backward_is_boundary()
        if self.data_parallel is not None:
            self.data_parallel.sync = self._micro_boundary

    def _end_micro_batch(self) -> None:
        """After a micro-batch's backward: count it; at the boundary, wait for the reduction."""
        self.micro_steps += 1
        self._backward_since_step = True
        if self._micro_boundary:
            with self._timed("backward_allreduce", self._wall_clock_breakdown):
                if self.data_parallel is not None:
                    self.data_parallel.finish_grad_sync()
                self._allreduce_sequence_parallel_grads()

    def _allreduce_sequence_parallel_grads(self) -> None:
        """Sum over TP the gradients of replicated parameters that ran on sequence shards.

        Once per step, after the data-parallel average (the two commute): LayerNorms, row-
        parallel biases and position embeddings under ``--sequence-parallel`` (marked
        ``sequence_parallel``). Their gradient lives in ``main_grad`` (data parallel, 16-bit
        params) or ``.grad``; all of one dtype go in one flat all-reduce.
        """
        tp = state().tp
        if tp.size == 1 or not self._sp_params:
            return
        self.optimizer_part.allreduce_grads(self._sp_params, tp)

    def _dp_mean(self, loss: Tensor) -> Tensor:
        """``loss`` averaged over the data-parallel ranks (the value every rank reports)."""
        if self.data_parallel is None:
            return loss
        return comm.all_reduce(loss.clone(), self.data_parallel.group, op="avg")

    def step(self, lr_kwargs: Mapping[str, Any] | None = None) -> StepResult | None:
        """At an accumulation boundary: optimizer step (skipped on overflow), then scheduler
        (``lr_scheduler.step(**lr_kwargs)`` when given, DeepSpeed's); else nothing."""
        self._step_applied = False
        boundary = self.is_gradient_accumulation_boundary()
        self._backward_since_step = False
        if not boundary:
            self.tput_timer.stop(global_step=False)
            return None
        timing = self._wall_clock_breakdown
        with self._timed("step", timing):
            result = self.optimizer_part.step()
            self._step_applied = result.update_successful
            if result.update_successful and self.lr_scheduler is not None:
                if lr_kwargs:
                    self.lr_scheduler.step(**lr_kwargs)
                else:
                    self.lr_scheduler.step(self.lr_increment)
            self.global_steps += 1
            self.global_samples += self.train_batch_size()
            self.last_step = result
            if self.monitor.enabled:
                self._write_monitor_events()
        self.tput_timer.stop(global_step=True)
        flops_profiler.after_step(self)  # the config's flops_profiler prints its profiled step
        every = self._steps_per_print
        if timing and every and self.global_steps % every == 0:
            self._print_wall_clock()
        autotuning_metrics.after_step(self)  # an autotuning experiment ends after its profile
        step_profile.after_step(self)  # --profile-steps: the recording ends after its last step
        return result

    def _write_monitor_events(self) -> None:
        scaled = getattr(self.optimizer, "loss_scaler", None) is not None  # fp16
        events = training_events(
            self._monitor_losses,
            float(self.get_lr()[0]),
            float(self.cur_scale) if scaled else None,
            self.global_samples,
        )
        self._monitor_losses = []
        self.monitor.write_events(events)

    def wall_clock_summary(self, reset: bool = True) -> dict[str, float]:
        """Milliseconds spent per DeepSpeed phase since the last reset (wall_clock_breakdown)."""
        return {name: self.timers(name).elapsed(reset) * 1000.0 for name in WALL_CLOCK_TIMERS}

    def _print_wall_clock(self) -> None:
        line = wall_clock_line(self.wall_clock_summary(), self.global_steps)
        if state().rank == 0:
            print(line, flush=True)

    # ---- whole batches (Megatron's loop, pipeline models) -----------------------------------

    def _next_batch(self, data_iter: Iterator) -> Any:
        with self._timed("batch-generator"):
            return _to_device(next(data_iter), self.device)

    def train_batch(self, data_iter: Iterator | None = None) -> Tensor:
        """Forward and backward over one global batch's micro-batches, then step.

        ``data_iter`` None: the iterator of the last call, else over initialize's
        ``training_data`` (DeepSpeed's). Returns the mean loss over the micro-batches and
        data-parallel ranks (a detached scalar, the same on every rank).
        """
        data_iter = self._data_iter(data_iter)
        if self.pipeline is not None:
            return self._train_batch_pipeline(data_iter)
        assert self.loss_fn is not None, "train_batch needs Engine(loss_fn=...)"
        self.module.train()
        losses = []
        model = self if self._wall_clock_breakdown else self._forward  # times "forward"
        for _ in range(self._gas):
            batch = self._next_batch(data_iter)
            with self._timed("forward-backward"):
                loss = self.loss_fn(model, batch)
                self.backward(loss)
            losses.append(loss.detach())
        with self._timed("optimizer"):
            self.step()
        return self._dp_mean(torch.stack(losses).float().mean())

    @torch.no_grad()
    def eval_batch(self, data_iter: Iterator) -> Tensor:
        """Mean loss over one global batch's micro-batches (and data-parallel ranks), without
        gradients or dropout."""
        was_training = self.module.training
        if self.pipeline is not None:
            try:
                loss = self.pipeline.eval_step(self._batches(data_iter))
            finally:
                self.module.train(was_training)
            return self._dp_mean(self._from_last_stage(loss))
        assert self.loss_fn is not None, "eval_batch needs Engine(loss_fn=...)"
        self.module.eval()
        try:
            losses = [
                self.loss_fn(self._forward, self._next_batch(data_iter)) for _ in range(self._gas)
            ]
        finally:
            self.module.train(was_training)
        return self._dp_mean(torch.stack(losses).float().mean())

    # ---- pipeline parallelism -------------------------------------------------------------

    def _batches(self, data_iter: Iterator) -> Iterator:
        """``data_iter``'s micro-batches on this device, drawn one at a time by the runtime."""
        while True:
            try:
                yield self._next_batch(data_iter)
            except StopIteration:
                return

    def _train_batch_pipeline(self, data_iter: Iterator) -> Tensor:
        """One step of the pipeline schedule over the global batch's micro-batches, then step.

        The data-parallel buckets stay quiet through the schedule (they would otherwise reduce
        on every micro-batch's backward) and are reduced once, after the last backward.
        """
        pipe, dp = self.pipeline, self.data_parallel
        self.tput_timer.start()
        started = self._pipe_batch_timer()
        with self._timed("forward-backward"):
            with dp.no_sync() if dp is not None else nullcontext():
                loss = pipe.train_step(self._batches(data_iter), grad_scale=self.cur_scale)
            # Where the data-parallel reduction leaves partitions (ZeRO), the tied weights' sum
            # over their stages must come first; otherwise after it (the two sums commute).
            tied_first = self.optimizer_part.grads_freed
            if tied_first:
                self._allreduce_tied_grads()
            if dp is not None:
                dp.finish_grad_sync()
            if not tied_first:
                self._allreduce_tied_grads()
            self._allreduce_sequence_parallel_grads()
        self.micro_steps += self._gas
        self._backward_since_step = True
        loss = self._from_last_stage(loss)
        if self.monitor.enabled:
            self._monitor_losses = [loss.detach()]
        with self._timed("optimizer"):
            self.step()
        loss = self._dp_mean(loss)
        self._print_pipeline_progress(loss, started)
        return loss

    def _allreduce_tied_grads(self) -> None:
        """Sum the tied weights' gradients over the pipeline stages that hold a copy (each stage
        module declares its own, :mod:`zerotron.parallel.declarations`)."""
        allreduce_tied_grads(self.pipeline.modules)

    def _from_last_stage(self, loss: Tensor | None) -> Tensor:
        """The last pipeline stage's ``loss``, broadcast to every stage of the pipeline group."""
        pp = state().pp
        if pp.size == 1:
            assert loss is not None
            return loss
        value = torch.zeros((), device=self.device) if loss is None else loss.float().clone()
        return comm.broadcast(value, pp, pp.size - 1)

    # ---- checkpoints (zerotron.engine.checkpoint_io) ---------------------------------------

    def save_checkpoint(
        self,
        save_dir: str | Path,
        tag: str | None = None,
        client_state: Mapping[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
        *,
        save_optimizer: bool = True,
        save_rng: bool = True,
    ) -> Path:
        """Write ``<save_dir>/<tag>/`` (default tag ``global_step{N}``, DeepSpeed's), with
        ``client_state`` beside the engine's own entries, without the weights of parameters
        that do not require grad with ``exclude_frozen_parameters``; every rank calls it (see
        :func:`~zerotron.engine.checkpoint_io.save_engine_checkpoint`)."""
        tag = tag or f"global_step{self.global_steps}"
        return checkpoint_io.save_engine_checkpoint(
            self, save_dir, tag, client_state, save_latest, save_optimizer, save_rng,
            exclude_frozen_parameters,
        )  # fmt: skip

    def load_checkpoint(
        self,
        load_dir: str | Path,
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Callable[..., None] | None = None,
        *,
        load_rng: bool = True,
    ) -> tuple[str | None, dict[str, Any] | None]:
        """Load a checkpoint (``tag`` None: the one ``latest`` names); returns ``(path,
        client_state)`` as DeepSpeed does (``(None, None)`` when there is no ``latest``) (see
        :func:`~zerotron.engine.checkpoint_io.load_engine_checkpoint`). ``load_module_strict``
        False keeps the module's own values of weights the checkpoint lacks (saved with
        ``exclude_frozen_parameters``); ``custom_load_fn(src=weights, dst=module)`` loads the
        weights instead of the Engine."""
        return checkpoint_io.load_engine_checkpoint(
            self, load_dir, tag, load_optimizer_states, load_lr_scheduler_states,
            load_module_only, load_rng, load_module_strict, custom_load_fn,
        )  # fmt: skip

    def load_imported(
        self, ckpt: InMemoryCheckpoint, load_optimizer_states: bool = True
    ) -> tuple[str, dict[str, Any]]:
        """Load a checkpoint another tool wrote, read into memory (Megatron-DeepSpeed's
        training state, say), as if this Engine had saved it; returns ``(where,
        client_state)`` (see :func:`~zerotron.engine.checkpoint_io.load_imported_checkpoint`)."""
        return checkpoint_io.load_imported_checkpoint(self, ckpt, load_optimizer_states)

    def load_weights(
        self, weights: Mapping[str, Tensor], meta: Mapping[str, Any], where: str
    ) -> None:
        """Load this rank's weights read from elsewhere than a zerotron checkpoint (named as
        the module names them; ``meta``: the metadata.json a zerotron checkpoint of them would
        have, for the fitter). The masters follow the weights; the optimizer state and the
        step counters are left as they are (see
        :func:`~zerotron.engine.checkpoint_io.load_weights`)."""
        checkpoint_io.load_weights(self, weights, meta, where)
