"""The Engine: the one object a training loop talks to.

It composes parts that live in their own modules — the model, master weights and loss scaling
(``precision.mixed``), the LR schedule (``optim``), checkpoints (``checkpoint``) — and gives them
DeepSpeed's engine API: ``engine(batch)``, ``backward(loss)``, ``step()``, ``train_batch()``,
``eval_batch()``, ``save_checkpoint()``, ``load_checkpoint()``. The loop never touches loss
scales, master weights or gradients: the Engine owns them.

Data parallelism plugs in as a part (:class:`~zerotron.parallel.data_parallel.DataParallel`): the
Engine tells it which micro-batch ends an accumulation (only that backward reduces gradients),
waits for its buckets before the optimizer step, and reports losses averaged over the
data-parallel group. :func:`grad_norm_hooks` gives the optimizer the ``reduce_fn`` and
``is_counted`` that make the gradient norm and the overflow check span the model-parallel ranks.
Checkpoints hold one file per model-parallel rank, written by data-parallel rank 0.

Pipeline parallelism plugs in as a
:class:`~zerotron.parallel.pipeline.PipelineRuntime` over this rank's model chunks (``model`` is
then the module holding them, e.g. ``training.build.StageModel``). Only whole batches make sense
there (:meth:`Engine.train_batch`, :meth:`Engine.eval_batch`): the runtime runs the step's
micro-batches on its schedule, with data-parallel reduction held back until all of them are done;
then the tied weights' gradients (as the chunks declare them,
:func:`~zerotron.parallel.declarations.allreduce_tied_grads`) are summed over their stages, the
sequence-parallel ones over TP, and the optimizer steps. The loss, known on the last stage only, is
broadcast over the pipeline group so every rank returns the same value.

ZeRO plugs in as the optimizer: a :class:`~zerotron.zero.ZeroOptimizer` speaks both protocols
the Engine uses — the optimizer's (``step``, ``scale_loss``, ``state_dict``, ...) and
DataParallel's (``group``, ``sync``, ``finish_grad_sync``, ``no_sync``) — so it is passed as
``optimizer`` (and, or by default, as ``data_parallel``). Checkpoints then hold, besides one
model file per model-parallel rank (weights, scheduler, RNG, counters; no optimizer state),
one ``zero_dp_rank_{dp}_mp_rank_{tp:02d}_{pp:03d}_optim_states.pt`` per rank with that rank's
partition (``ZeroOptimizer.state_dict()``), which ``zerotron zero-to-fp32`` consolidates
offline. Under stage 3 the model file holds the gathered 16-bit weights.
"""

from __future__ import annotations

import hashlib
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from zerotron.checkpoint import (
    get_rng_state,
    load_file,
    load_model_state,
    model_file,
    read_metadata,
    repad_vocab,
    resolve_tag,
    save_checkpoint,
    set_rng_state,
)
from zerotron.checkpoint.layout import CHECKPOINT_VERSION, zero_file
from zerotron.checkpoint.layout import tag_dir as layout_tag_dir
from zerotron.checkpoint.reshard import (
    checkpoint_layout,
    load_model_state_for,
    load_shared_entries,
)
from zerotron.checkpoint.zero_repartition import repartition_zero_state
from zerotron.checkpoint.zero_to_fp32 import SHARED_PARAMS_KEY
from zerotron.distributed import comm
from zerotron.distributed.init import get_world_size
from zerotron.distributed.rng import get_rng_tracker
from zerotron.distributed.state import ParallelState, state
from zerotron.errors import CheckpointError, ConfigError, UnsupportedError
from zerotron.fileio import atomic_open
from zerotron.kernels import apply_process_settings
from zerotron.monitor import MonitorMaster
from zerotron.parallel.data_parallel import DataParallel
from zerotron.parallel.declarations import allreduce_tied_grads
from zerotron.parallel.pipeline import PipelineRuntime
from zerotron.precision.grads import IsCounted, ReduceFn, grad_of
from zerotron.precision.mixed import LOW_PRECISION, MixedPrecisionOptimizer, StepResult

LossFn = Callable[[nn.Module, Mapping[str, Any]], Tensor]
RNG_TRACKER_KEY = "rng_tracker_states"  # the tensor-parallel RNG streams, beside torch's
ZERO_STAGE_KEY = "zero_stage"  # model-file entries of a ZeRO checkpoint
DP_SIZE_KEY = "dp_world_size"
GATHERED_16BIT_FILE = "pytorch_model.bin"
"""Consolidated 16-bit weights in a tag directory (stage3_gather_16bit_weights_on_model_save)."""
# DeepSpeed's wall_clock_breakdown timers, printed every steps_per_print steps
WALL_CLOCK_TIMERS = ("forward", "backward", "backward_allreduce", "step")


def grad_norm_hooks(ps: ParallelState | None = None) -> tuple[ReduceFn | None, IsCounted]:
    """``(reduce_fn, is_counted)`` for :class:`MixedPrecisionOptimizer` on this rank's layout.

    After the data-parallel all-reduce every DP rank holds the same gradients, so the norm and
    the overflow flag are combined over the model-parallel group (tp × pp) only. A parameter is
    counted once across it: tensor-parallel shards (``tensor_model_parallel=True``) on every TP
    rank, replicated ones (LayerNorm, biases of row-parallel layers) on TP rank 0 only, and a
    parameter marked ``shared`` (the last stage's copy of the tied embedding, when pp > 1) on the
    stage that does not own it not at all (Megatron's ``param_is_not_shared``).
    """
    ps = ps or state()
    mp = ps.mp
    reduce_fn = None if mp.size == 1 else (lambda t, op: comm.all_reduce(t, mp, op))
    tp_rank = ps.tp_rank

    def is_counted(param: Tensor) -> bool:
        if getattr(param, "shared", False):
            return False
        return bool(getattr(param, "tensor_model_parallel", False)) or tp_rank == 0

    return reduce_fn, is_counted


class _NullTimer:
    def start(self) -> None: ...

    def stop(self) -> None: ...

    def elapsed(self, reset: bool = True) -> float:
        return 0.0


class _WallClockTimer:
    """Seconds between start() and stop(), summed until read (CUDA synchronized)."""

    def __init__(self) -> None:
        self.total = 0.0
        self._started: float | None = None

    def start(self) -> None:
        _sync_device()
        self._started = time.perf_counter()

    def stop(self) -> None:
        if self._started is not None:
            _sync_device()
            self.total += time.perf_counter() - self._started
            self._started = None

    def elapsed(self, reset: bool = True) -> float:
        value = self.total
        if reset:
            self.total = 0.0
        return value


class _WallClockTimers(dict):
    """``timers(name)`` -> a timer created on first use (DeepSpeed's wall_clock_breakdown)."""

    def __call__(self, name: str) -> _WallClockTimer:
        if name not in self:
            self[name] = _WallClockTimer()
        return self[name]


def _sync_device() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _module_device(model: nn.Module) -> torch.device:
    """Where the module computes: its first parameter's (or buffer's) device, else the CPU.

    Under ZeRO stage 3 a parameter's ``data`` is an empty tensor at rest, still on that device.
    """
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return torch.device("cpu")


def shared_params(module: nn.Module) -> dict[str, str]:
    """``{alias: name}`` for every parameter reachable under a second name (tied weights)."""
    first: dict[int, str] = {}
    out = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[name] = first[id(p)]
        else:
            first[id(p)] = name
    return out


def _parallel_state() -> ParallelState:
    return state()


def _check_layout(
    meta: Mapping[str, Any], ps: ParallelState, where: str, load_dir: str | Path = "CKPT"
) -> None:
    """Refuse optimizer states saved with another tensor/pipeline layout (they cannot be
    resharded; the weights alone can, see :meth:`Engine.load_checkpoint`)."""
    saved = checkpoint_layout(meta)
    if saved != (ps.tp_size, ps.pp_size):
        raise CheckpointError(
            f"the checkpoint was saved with tensor parallel {saved[0]} and pipeline parallel "
            f"{saved[1]}; this run has {ps.tp_size} and {ps.pp_size}, and optimizer states "
            "cannot be resharded",
            where=where,
            fix=f"resume with --tensor-model-parallel-size {saved[0]} "
            f"--pipeline-model-parallel-size {saved[1]} (the data-parallel size may differ); "
            "or load the weights alone (--finetune or --no-load-optim); or reshard them "
            f"offline: zerotron convert --load {load_dir} --save NEW_DIR "
            f"--target-tensor-parallel-size {ps.tp_size} "
            f"--target-pipeline-parallel-size {ps.pp_size}",
        )


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


class Engine:
    """Trains ``model`` with ``optimizer`` (a :class:`MixedPrecisionOptimizer` or a
    :class:`~zerotron.zero.ZeroOptimizer`).

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
        vocab_keys / orig_vocab_size: let checkpoints with another vocab padding load.
        compile: run the module's forward through ``torch.compile``.
        timers: optional ``timers(name).start()/stop()`` (``training.timers.Timers``).
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
        optimizer: MixedPrecisionOptimizer,
        lr_scheduler: Any = None,
        *,
        loss_fn: LossFn | None = None,
        micro_batch_size: int = 1,
        gradient_accumulation_steps: int = 1,
        data_parallel_size: int = 1,
        lr_increment: int = 1,
        checkpoint_metadata: Mapping[str, Any] | None = None,
        vocab_keys: Sequence[str] = (),
        orig_vocab_size: int | None = None,
        compile: bool = False,
        timers: Callable[[str], Any] | None = None,
        data_parallel: DataParallel | None = None,
        pipeline: PipelineRuntime | None = None,
        wall_clock_breakdown: bool = False,
        steps_per_print: int | None = None,
        device: torch.device | str | None = None,
        monitor: MonitorMaster | None = None,
        checkpoint_tag_validation: str = "Warn",
    ):
        if checkpoint_tag_validation not in ("Ignore", "Warn", "Fail"):
            raise ConfigError(
                f"checkpoint_tag_validation is {checkpoint_tag_validation!r}",
                where="Engine",
                fix="use 'Ignore', 'Warn' or 'Fail'",
            )
        if pipeline is not None and pipeline.num_microbatches != gradient_accumulation_steps:
            raise UnsupportedError(
                f"the pipeline runs {pipeline.num_microbatches} micro-batches a step, but "
                f"gradient_accumulation_steps is {gradient_accumulation_steps}",
                where="Engine",
                fix="build PipelineRuntime with num_microbatches = gradient_accumulation_steps",
            )
        if pipeline is not None and compile:
            raise UnsupportedError(
                "torch.compile of pipeline stages", where="Engine", fix="drop --compile"
            )
        self._zero_stage = int(getattr(optimizer, "stage", 0) or 0)
        if self._zero_stage:
            if data_parallel is None:
                data_parallel = optimizer  # a ZeroOptimizer reduces the gradients itself
            elif data_parallel is not optimizer:
                raise ConfigError(
                    "ZeRO reduces gradients in its optimizer, but another data-parallel part "
                    f"({type(data_parallel).__name__}) was given as well",
                    where="Engine",
                    fix="pass the ZeroOptimizer as data_parallel (or leave it None)",
                )
            if pipeline is not None and self._zero_stage > 1:
                raise UnsupportedError(
                    f"ZeRO stage {self._zero_stage} with pipeline parallelism (as in DeepSpeed)",
                    where="zero_optimization.stage",
                    fix="use ZeRO stage 1 with pipeline parallelism",
                )
        self.module = model
        self.pipeline = pipeline
        self.data_parallel = data_parallel
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.loss_fn = loss_fn
        self._micro_batch_size = micro_batch_size
        self._gas = gradient_accumulation_steps
        if data_parallel is not None and data_parallel_size == 1:
            data_parallel_size = data_parallel.group.size
        self.data_parallel_size = data_parallel_size
        self.lr_increment = lr_increment
        self.checkpoint_metadata = dict(checkpoint_metadata or {})
        self.vocab_keys = tuple(vocab_keys)
        self.orig_vocab_size = orig_vocab_size
        self._wall_clock_breakdown = wall_clock_breakdown
        self.steps_per_print = steps_per_print
        if timers is None:
            timers = _WallClockTimers() if wall_clock_breakdown else (lambda name: _NullTimer())
        self.timers = timers
        self.device = torch.device(device) if device is not None else _module_device(model)
        apply_process_settings(self.device, get_world_size())  # e.g. glibc's kept heap (CPU)
        # Compile the call, not the module: state-dict keys and parameters stay the module's.
        self._forward = torch.compile(model) if compile else model

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

    # ---- sizes (DeepSpeed's names) --------------------------------------------------------

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self._gas

    def train_batch_size(self) -> int:
        return self._micro_batch_size * self._gas * self.data_parallel_size

    def zero_optimization_stage(self) -> int:
        """The ZeRO stage of the optimizer (0: none)."""
        return self._zero_stage

    def wall_clock_breakdown(self) -> bool:
        return self._wall_clock_breakdown

    # ---- state ----------------------------------------------------------------------------

    @property
    def skipped_steps(self) -> int:
        return self.optimizer.num_skipped_steps

    @property
    def cur_scale(self) -> float:
        return self.optimizer.loss_scale

    loss_scale = cur_scale

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.micro_steps % self._gas == 0

    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        return self.train(False)

    # ---- one micro-batch at a time (DeepSpeed's loop) ---------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._refuse_under_pipeline("engine(batch)")
        if not self._wall_clock_breakdown:
            return self._forward(*args, **kwargs)
        timer = self.timers("forward")
        timer.start()
        try:
            return self._forward(*args, **kwargs)
        finally:
            timer.stop()

    forward = __call__

    def _refuse_under_pipeline(self, what: str) -> None:
        if self.pipeline is not None:
            raise UnsupportedError(
                f"{what} under pipeline parallelism: a stage sees no whole model",
                where="Engine",
                fix="use engine.train_batch(data_iter) / engine.eval_batch(data_iter)",
            )

    def backward(self, loss: Tensor) -> None:
        """Backward of one micro-batch's loss: divided by the accumulation steps, then scaled.

        When gradients are reduced over the data-parallel ranks (DeepSpeed's semantics):

        - plain data parallelism and ZeRO stages 0/1: only on the micro-batch that ends an
          accumulation (its buckets overlap with its backward); the earlier ones accumulate
          locally;
        - ZeRO stages 2/3: on *every* micro-batch, each bucket reduce-scattered into the ranks'
          gradient partitions as soon as its gradients are in, so no full gradient outlives
          its bucket.

        At the boundary this call returns once everything is reduced.
        """
        self._refuse_under_pipeline("engine.backward(loss)")
        timing = self._wall_clock_breakdown
        if timing:
            self.timers("backward").start()
        if self.monitor.enabled:
            self._monitor_losses.append(loss.detach())
        if self._gas > 1:
            loss = loss / self._gas
        dp = self.data_parallel
        boundary = (self.micro_steps + 1) % self._gas == 0
        if dp is not None:
            dp.sync = boundary
        self.optimizer.scale_loss(loss).backward()
        self.micro_steps += 1
        if boundary:
            if timing:
                self.timers("backward_allreduce").start()
            if dp is not None:
                dp.finish_grad_sync()
            self._allreduce_sequence_parallel_grads()
            if timing:
                self.timers("backward_allreduce").stop()
        if timing:
            self.timers("backward").stop()

    def _allreduce_sequence_parallel_grads(self) -> None:
        """Sum over TP the gradients of replicated parameters that ran on sequence shards.

        Once per step, after the data-parallel average (the two commute): LayerNorms, row-
        parallel biases and position embeddings under ``--sequence-parallel`` (marked
        ``sequence_parallel``). Their gradient lives in ``main_grad`` (data parallel, 16-bit
        params) or ``.grad``; all of one dtype go in one flat all-reduce.
        """
        tp = _parallel_state().tp
        if tp.size == 1 or not self._sp_params:
            return
        if self._zero_stage:  # ZeRO has freed the full gradients: sum its partitions instead
            self.optimizer.allreduce_grads(self._sp_params, tp)
            return
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for p in self._sp_params:
            g = grad_of(p)
            if g is not None:
                by_dtype.setdefault(g.dtype, []).append(g)
        for grads in by_dtype.values():
            flat = comm.all_reduce(torch.cat([g.reshape(-1) for g in grads]), tp)
            parts = flat.split([g.numel() for g in grads])
            torch._foreach_copy_(grads, [f.view_as(g) for f, g in zip(parts, grads)])

    def _dp_mean(self, loss: Tensor) -> Tensor:
        """``loss`` averaged over the data-parallel ranks (the value every rank reports)."""
        if self.data_parallel is None:
            return loss
        return comm.all_reduce(loss.clone(), self.data_parallel.group, op="avg")

    def step(self) -> StepResult | None:
        """At an accumulation boundary: optimizer step (skipped on overflow), then scheduler."""
        if not self.is_gradient_accumulation_boundary():
            return None
        timing = self._wall_clock_breakdown
        if timing:
            self.timers("step").start()
        result = self.optimizer.step()
        if result.update_successful and self.lr_scheduler is not None:
            self.lr_scheduler.step(self.lr_increment)
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
        self.last_step = result
        if self.monitor.enabled:
            self._write_monitor_events()
        if timing:
            self.timers("step").stop()
            if self.steps_per_print and self.global_steps % self.steps_per_print == 0:
                self._print_wall_clock()
        return result

    def _write_monitor_events(self) -> None:
        """DeepSpeed's per-step events, keyed by the samples seen after this step:
        ``Train/Samples/train_loss`` (this rank's micro-batch losses as backward saw them,
        averaged over the accumulation), ``Train/Samples/lr`` (the first group's, after the
        scheduler stepped) and, with fp16 loss scaling, ``Train/Samples/loss_scale``."""
        step = self.global_samples
        events: list[tuple[str, float, int]] = []
        if self._monitor_losses:
            mean = torch.stack(self._monitor_losses).float().mean()
            events.append(("Train/Samples/train_loss", mean.item(), step))
            self._monitor_losses = []
        events.append(("Train/Samples/lr", float(self.get_lr()[0]), step))
        if getattr(self.optimizer, "loss_scaler", None) is not None:  # fp16
            events.append(("Train/Samples/loss_scale", float(self.cur_scale), step))
        self.monitor.write_events(events)

    def destroy(self) -> None:
        """Close the monitors (flushing their files); the engine can still train, unmonitored."""
        self.monitor.close()

    def wall_clock_summary(self, reset: bool = True) -> dict[str, float]:
        """Milliseconds spent per DeepSpeed phase since the last reset (wall_clock_breakdown)."""
        return {name: self.timers(name).elapsed(reset) * 1000.0 for name in WALL_CLOCK_TIMERS}

    def _print_wall_clock(self) -> None:
        times = self.wall_clock_summary()
        if _parallel_state().rank == 0:
            parts = " | ".join(f"{name}: {ms:.2f}" for name, ms in times.items())
            print(f"[step {self.global_steps}] time (ms) | {parts}", flush=True)

    # ---- whole batches (Megatron's loop, pipeline models) -----------------------------------

    def _next_batch(self, data_iter: Iterator) -> Any:
        timer = self.timers("batch-generator")
        timer.start()
        batch = _to_device(next(data_iter), self.device)
        timer.stop()
        return batch

    def train_batch(self, data_iter: Iterator) -> Tensor:
        """Forward and backward over one global batch's micro-batches, then step.

        Returns the mean loss over the micro-batches and data-parallel ranks (a detached scalar,
        the same on every rank).
        """
        if self.pipeline is not None:
            return self._train_batch_pipeline(data_iter)
        assert self.loss_fn is not None, "train_batch needs Engine(loss_fn=...)"
        self.module.train()
        losses = []
        fb = self.timers("forward-backward")
        model = self if self._wall_clock_breakdown else self._forward  # times "forward"
        for _ in range(self._gas):
            batch = self._next_batch(data_iter)
            fb.start()
            loss = self.loss_fn(model, batch)
            self.backward(loss)
            fb.stop()
            losses.append(loss.detach())
        opt = self.timers("optimizer")
        opt.start()
        self.step()
        opt.stop()
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
        pipe = self.pipeline
        dp = self.data_parallel
        fb = self.timers("forward-backward")
        fb.start()
        with dp.no_sync() if dp is not None else nullcontext():
            loss = pipe.train_step(self._batches(data_iter), grad_scale=self.optimizer.loss_scale)
        if self._zero_stage:
            # ZeRO's reduction turns full gradients into partitions: the tied weights' sum
            # over their stages must come first (the two sums commute).
            allreduce_tied_grads(pipe.modules)
            dp.finish_grad_sync()
        else:
            if dp is not None:
                dp.finish_grad_sync()
            allreduce_tied_grads(pipe.modules)
        self._allreduce_sequence_parallel_grads()
        fb.stop()
        self.micro_steps += self._gas
        loss = self._from_last_stage(loss)
        if self.monitor.enabled:
            self._monitor_losses = [loss.detach()]
        opt = self.timers("optimizer")
        opt.start()
        self.step()
        opt.stop()
        return self._dp_mean(loss)

    def _from_last_stage(self, loss: Tensor | None) -> Tensor:
        """The last pipeline stage's ``loss``, broadcast to every stage of the pipeline group."""
        pp = _parallel_state().pp
        if pp.size == 1:
            assert loss is not None
            return loss
        value = torch.zeros((), device=self.device) if loss is None else loss.float().clone()
        return comm.broadcast(value, pp, pp.size - 1)

    # ---- checkpoints ----------------------------------------------------------------------

    def save_checkpoint(
        self,
        save_dir: str | Path,
        tag: str | None = None,
        client_state: Mapping[str, Any] | None = None,
        save_latest: bool = True,
        *,
        save_optimizer: bool = True,
        save_rng: bool = True,
    ) -> Path:
        """Write ``<save_dir>/<tag>/`` (default tag ``global_step{N}``, DeepSpeed's).

        ``client_state`` entries are stored beside the engine's own and come back from
        :meth:`load_checkpoint`. Every rank must call this (collectively).

        Files: one model file per model-parallel rank, from data-parallel rank 0 (weights,
        scheduler, RNG, counters and, without ZeRO, the optimizer state); under ZeRO one
        partition file per rank (``ZeroOptimizer.state_dict()``), and under stage 3 with
        ``gather_16bit_weights_on_model_save`` also ``pytorch_model.bin`` (the consolidated
        16-bit state dict of this model-parallel rank; ``pytorch_model_mp_rank_XX_YYY.bin``
        when there are several).
        """
        tag = tag or f"global_step{self.global_steps}"
        ps = _parallel_state()
        self._validate_tag(tag, ps)
        module_state = self.module_state_dict(rank0_only=True)  # collective under stage 3
        state: dict[str, Any] = dict(client_state or {})
        state.update(
            model=module_state,
            checkpoint_version=CHECKPOINT_VERSION,
            global_steps=self.global_steps,
            global_samples=self.global_samples,
        )
        shared = shared_params(self.module)
        if shared:
            state[SHARED_PARAMS_KEY] = shared
        files: dict[str, Any] = {}
        if self._zero_stage:
            state[ZERO_STAGE_KEY] = self._zero_stage
            state[DP_SIZE_KEY] = self.data_parallel.group.size
        if save_optimizer:
            if self._zero_stage:
                files[zero_file(ps.dp_rank, ps.tp_rank, ps.pp_rank)] = self.optimizer.state_dict()
            else:
                state["optimizer"] = self.optimizer.state_dict()
            if self.lr_scheduler is not None:
                state["opt_param_scheduler"] = self.lr_scheduler.state_dict()
        if save_rng:
            tracker = get_rng_tracker().get_states()
            state["rng_state"] = [get_rng_state({RNG_TRACKER_KEY: tracker} if tracker else None)]
        # One model file per model-parallel rank, from its data-parallel rank 0 (the replicas
        # are equal); every rank takes part in the save's barriers.
        if ps.dp_rank == 0:
            files[self._model_file(ps)] = state
            if self._zero_stage == 3 and getattr(
                self.optimizer, "gather_16bit_weights_on_model_save", False
            ):
                files[self._gathered_16bit_file(ps)] = module_state
        return save_checkpoint(
            save_dir,
            tag,
            files,
            self._save_metadata(ps),
            save_latest=save_latest,
            is_writer=ps.rank == 0,
            barrier=comm.barrier if ps.world_size > 1 else None,
        )

    def _validate_tag(self, tag: str, ps: ParallelState) -> None:
        """Check that every rank saves under ``tag`` (``checkpoint_tag_validation``).

        All-gathers an 8-byte hash of the tag over the world; every rank sees the same result, so
        under ``Fail`` they all raise together and none is left waiting in the save's barriers.
        """
        if self.checkpoint_tag_validation == "Ignore" or ps.world_size == 1:
            return
        digest = hashlib.sha256(tag.encode("utf-8")).digest()[:8]
        mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.int64)
        hashes = comm.all_gather(mine.to(self.device), ps.world).cpu().tolist()
        if len(set(hashes)) == 1:
            return
        by_hash: dict[int, list[int]] = {}
        for i, h in enumerate(hashes):
            by_hash.setdefault(h, []).append(ps.world.global_rank(i))
        groups = sorted(by_hash.values())
        detail = "; ".join(f"ranks {ranks}" for ranks in groups)
        what = (
            f"ranks save under different checkpoint tags ({len(groups)} distinct tags: "
            f"{detail}); this rank's tag is {tag!r}"
        )
        fix = "pass the same tag on every rank (or none: the default is global_step<N>)"
        if self.checkpoint_tag_validation == "Fail":
            raise CheckpointError(what, where="checkpoint.tag_validation", fix=fix)
        warnings.warn(f"checkpoint.tag_validation: {what} -> {fix}", stacklevel=3)

    def module_state_dict(self, rank0_only: bool = False) -> dict[str, Any] | None:
        """The module's full state dict. Under ZeRO stage 3 its partitioned parameters are
        gathered one at a time into host copies (a collective: every data-parallel rank calls
        it); with ``rank0_only`` only data-parallel rank 0 keeps them (others get None)."""
        if self._zero_stage != 3:
            return self.module.state_dict()
        from zerotron.zero.stage3 import gathered_state_dict

        return gathered_state_dict(self.module, rank0_only, group=self.data_parallel.group)

    def save_16bit_model(
        self, save_dir: str | Path, save_filename: str = GATHERED_16BIT_FILE
    ) -> Path:
        """Write the module's (gathered) state dict to ``save_dir/save_filename`` on rank 0 of
        each model-parallel rank's data-parallel group (DeepSpeed's API; a collective)."""
        ps = _parallel_state()
        module_state = self.module_state_dict(rank0_only=True)
        path = Path(save_dir) / save_filename
        if ps.dp_rank == 0 and ps.mp.size > 1:
            path = path.with_name(f"{path.stem}_{self._model_file(ps).split('/')[0]}{path.suffix}")
        if ps.dp_rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_open(path) as f:
                torch.save(module_state, f)
        if ps.world_size > 1:
            comm.barrier()
        return path

    def _save_metadata(self, ps: ParallelState) -> dict[str, Any]:
        meta = dict(self.checkpoint_metadata)
        lay = dict(meta.get("layout") or {})
        lay.setdefault("tensor_model_parallel_size", ps.tp_size)
        lay.setdefault("pipeline_model_parallel_size", ps.pp_size)
        lay["data_parallel_size"] = ps.dp_size
        lay["zero_stage"] = self._zero_stage
        meta["layout"] = lay
        return meta

    def _read_model_file(
        self,
        load_dir: str | Path,
        tag: str,
        meta: Mapping[str, Any],
        ps: ParallelState,
        weights_only: bool,
        where: str,
    ) -> dict[str, Any]:
        """This rank's model file. From another tensor/pipeline layout, and only when no
        optimizer state is wanted: this rank's weights merged and split from every file
        (``checkpoint.reshard``) with the counters all files share; no optimizer or RNG state."""
        if checkpoint_layout(meta) == (ps.tp_size, ps.pp_size):
            return load_file(load_dir, tag, self._model_file(ps))
        if not weights_only:
            _check_layout(meta, ps, where, load_dir)  # raises, naming zerotron convert
        weights, _ = load_model_state_for(
            load_dir,
            tag,
            ps.tp_rank,
            ps.tp_size,
            ps.pp_rank,
            ps.pp_size,
            padded_vocab_size=(self.checkpoint_metadata.get("vocab") or {}).get("padded_size"),
            virtual_stages=ps.virtual_pipeline_size or 1,
        )
        return {**load_shared_entries(load_dir, tag), "model": weights}

    @staticmethod
    def _model_file(ps: ParallelState) -> str:
        return model_file(ps.tp_rank, ps.pp_rank, ps.pp_size)

    @staticmethod
    def _gathered_16bit_file(ps: ParallelState) -> str:
        if ps.mp.size == 1:
            return GATHERED_16BIT_FILE
        return f"pytorch_model_mp_rank_{ps.tp_rank:02d}_{ps.pp_rank:03d}.bin"

    def load_checkpoint(
        self,
        load_dir: str | Path,
        tag: str | None = None,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        *,
        load_rng: bool = True,
    ) -> tuple[str, dict[str, Any]]:
        """Load a checkpoint; returns ``(path, client_state)`` as DeepSpeed does.

        ``tag`` None means the tag the ``latest`` file names. ``load_module_only`` (Megatron's
        ``--finetune``) loads weights and nothing else: step counters stay at zero. Under ZeRO
        each rank reads its own partition file; a checkpoint saved with another data-parallel
        size is re-partitioned from all of them (masters and elementwise optimizer state, see
        :mod:`zerotron.checkpoint.zero_repartition`) unless :attr:`repartition_zero_checkpoints`
        is off (then it is refused, naming ``zerotron zero-to-fp32``).
        """
        tag = resolve_tag(load_dir, tag)
        where = str(Path(load_dir) / tag)
        ps = _parallel_state()
        meta = read_metadata(load_dir, tag)
        weights_only = load_module_only or not load_optimizer_states
        state = self._read_model_file(load_dir, tag, meta, ps, weights_only, where)
        if "model" not in state:
            raise CheckpointError("no 'model' entry in the checkpoint", where=where)
        saved_stage = int(state.get(ZERO_STAGE_KEY, meta.get("layout", {}).get("zero_stage", 0)))
        want_optimizer = load_optimizer_states and not load_module_only
        zero_state = None
        if want_optimizer and self._zero_stage:
            zero_state = self._load_zero_state(load_dir, tag, state, meta, saved_stage, where)
        elif want_optimizer and saved_stage:
            raise CheckpointError(
                f"the optimizer state is partitioned over data-parallel ranks (ZeRO stage "
                f"{saved_stage}); this engine runs without ZeRO",
                where=where,
                fix=f"resume with ZeRO stage {saved_stage}, or load weights only "
                "(load_optimizer_states=False; `zerotron zero-to-fp32` gives the fp32 weights)",
            )
        ckpt_vocab_size = meta.get("vocab", {}).get("size", self.orig_vocab_size)
        if self._zero_stage == 3:
            from zerotron.zero.stage3 import load_full_state_dict

            try:
                load_full_state_dict(self.module, state["model"])
            except ConfigError as e:
                raise CheckpointError(f"{e.what}", where=where, fix=e.fix) from e
            repadded: list[str] = []
        else:
            repadded = load_model_state(
                self.module,
                state["model"],
                vocab_keys=self.vocab_keys,
                orig_vocab_size=ckpt_vocab_size,
                vocab_size=self.orig_vocab_size,
                ckpt_config=meta.get("model"),
                model_config=self.checkpoint_metadata.get("model"),
                where=where,
            )
        if load_module_only:
            self._reload_masters()
            return where, {}
        if zero_state is not None:
            if repadded:
                raise CheckpointError(
                    f"the vocabulary padding differs ({', '.join(repadded)}); partitioned "
                    "optimizer state cannot be re-padded",
                    where=where,
                    fix="resume with the tensor-parallel size that saved, or load weights only "
                    "(load_optimizer_states=False)",
                )
            self.optimizer.load_state_dict(zero_state)
            self._clear_modified()  # the masters came from the file, not from the 16-bit shards
        elif want_optimizer and "optimizer" in state:
            if repadded:
                self._repad_optimizer_state(state["optimizer"], repadded, ckpt_vocab_size)
            self.optimizer.load_state_dict(state["optimizer"])
        else:
            self._reload_masters()
        scheduler_state = state.get("opt_param_scheduler")
        if load_lr_scheduler_states and self.lr_scheduler is not None and scheduler_state:
            self.lr_scheduler.load_state_dict(scheduler_state)
        if load_rng and state.get("rng_state"):
            extra = set_rng_state(state["rng_state"][0], where=where)
            if extra.get(RNG_TRACKER_KEY):
                get_rng_tracker().set_states(extra[RNG_TRACKER_KEY])
        self.global_steps = int(state.get("global_steps", 0))
        self.global_samples = int(state.get("global_samples", 0))
        own = {
            "model",
            "optimizer",
            "opt_param_scheduler",
            "rng_state",
            "checkpoint_version",
            "global_steps",
            "global_samples",
            SHARED_PARAMS_KEY,
            ZERO_STAGE_KEY,
            DP_SIZE_KEY,
        }
        return where, {k: v for k, v in state.items() if k not in own}

    def _reload_masters(self) -> None:
        """Masters from the (just loaded) model weights."""
        self.optimizer.reload_model_params()
        self._clear_modified()

    def _clear_modified(self) -> None:
        # stage3.load_full_state_dict flags what it wrote so that an optimizer reloads those
        # masters; the Engine has just set them (from the file or the weights) itself.
        for p in self.module.parameters():
            if getattr(p, "zero_modified", False):
                p.zero_modified = False

    def _load_zero_state(
        self,
        load_dir: str | Path,
        tag: str,
        state: Mapping[str, Any],
        meta: Mapping[str, Any],
        saved_stage: int,
        where: str,
    ) -> dict[str, Any]:
        """This rank's ZeRO partition file, after checking it was saved by this layout."""
        ps = _parallel_state()
        if not saved_stage:
            raise CheckpointError(
                f"the checkpoint holds a whole (not partitioned) optimizer state; this engine "
                f"runs ZeRO stage {self._zero_stage}",
                where=where,
                fix="resume without ZeRO, or load weights only (load_optimizer_states=False)",
            )
        saved_dp = int(state.get(DP_SIZE_KEY, meta.get("layout", {}).get("data_parallel_size", 0)))
        dp = self.data_parallel.group.size
        if saved_dp != dp and self.repartition_zero_checkpoints:
            # Cut the saved partitions again for this data-parallel size (masters and
            # elementwise optimizer state), from the layout entries of all saved files.
            return repartition_zero_state(
                layout_tag_dir(load_dir, tag), ps.tp_rank, ps.pp_rank, self.optimizer.state_dict()
            )
        if saved_dp != dp:
            raise CheckpointError(
                f"the ZeRO optimizer state is partitioned over {saved_dp} data-parallel ranks; "
                f"this run has {dp}",
                where=where,
                fix=f"resume with {saved_dp} data-parallel ranks, or consolidate the weights with "
                f"`zerotron zero-to-fp32 {load_dir} OUT --tag {tag}` and start from them "
                "(load_optimizer_states=False also loads the weights alone)",
            )
        zero_state = load_file(load_dir, tag, zero_file(ps.dp_rank, ps.tp_rank, ps.pp_rank))
        if zero_state.get("dp_rank", ps.dp_rank) != ps.dp_rank:
            raise CheckpointError(
                f"the partition file names dp_rank {zero_state.get('dp_rank')}",
                where=f"{where}/{zero_file(ps.dp_rank, ps.tp_rank, ps.pp_rank)}",
                fix="the files were renamed or mixed: restore the checkpoint as saved",
            )
        return zero_state

    def _repad_optimizer_state(
        self, opt_state: dict[str, Any], repadded: Sequence[str], orig_vocab_size: int
    ) -> None:
        """Re-pad the optimizer's state of re-padded vocabulary tensors as their weights were.

        Adam's moments and the fp32 master of such a tensor have the checkpoint's padded rows;
        stepping them against the model's other row count would be wrong (fused kernels do not
        even check). Real rows are kept, padding rows start at zero.
        """
        names = {id(p): n for n, p in self.module.named_parameters()}
        per_param = opt_state["optimizer"]["state"]
        masters = opt_state.get("fp32_from_fp16_params") or []
        flat = 0  # torch numbers state entries over all groups in order, as model_params
        for g, group in enumerate(self.optimizer.param_groups):
            low = 0  # position among this group's 16-bit params (fp32_from_fp16_params[g])
            for _ in group["params"]:
                param = self.optimizer.model_params[flat]
                is_16bit = param.dtype in LOW_PRECISION
                if names.get(id(param)) in repadded:
                    rows = param.shape[0]
                    for key, value in per_param.get(flat, {}).items():
                        if isinstance(value, Tensor) and value.dim() == param.dim():
                            per_param[flat][key] = repad_vocab(value, orig_vocab_size, rows)
                    if is_16bit and g < len(masters) and low < len(masters[g]):
                        masters[g][low] = repad_vocab(masters[g][low], orig_vocab_size, rows)
                low += is_16bit
                flat += 1
