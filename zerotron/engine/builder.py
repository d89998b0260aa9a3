"""The one place an :class:`~zerotron.engine.Engine` is assembled.

``zerotron pretrain`` (:mod:`zerotron.training.build`), DeepSpeed's ``initialize()``
(:mod:`zerotron.compat.api`) and ``pipeline_engine()`` (:mod:`zerotron.compat.pipe.engine`) all call
:func:`build_engine`. Given the model (in the training dtype, on its device) and a fresh torch
optimizer over its parameters, it

1. wraps the optimizer for precision and data parallelism (:func:`wrap_optimizer`): ZeRO stage
   0 gives a :class:`~zerotron.parallel.data_parallel.DataParallel` (None for one replica,
   built first so that the optimizer sees its ``main_grad`` buffers) and a
   :class:`~zerotron.precision.mixed.MixedPrecisionOptimizer`; stages 1-3 a
   :class:`~zerotron.zero.ZeroOptimizer`, which is both (stage 3 partitions the model's
   parameters first, with the offload_param store when asked). The gradient norm and the
   overflow check span the model-parallel ranks (:func:`grad_norm_hooks`);
2. builds the LR schedule over the wrapped optimizer (the caller's ``scheduler`` factory; the
   config's schedule is :func:`build_scheduler`);
3. hands the parts to the Engine with the caller's options (loss function, batch sizes,
   checkpoint metadata and fitter, pipeline runtime, timers, monitors).

How the optimizer is wrapped is an :class:`OptimizerSetup`, read from a Config by
:meth:`OptimizerSetup.from_config` or given directly (``pipeline_engine`` has no Config).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from zerotron.distributed import comm
from zerotron.distributed.state import ParallelState, state
from zerotron.engine import autotuning_metrics, run_metrics
from zerotron.engine import flops_profiler as flops_profiling
from zerotron.engine.core import Engine
from zerotron.engine.optimizers import NoOptimizer
from zerotron.optim import OptimizerParamScheduler, build_ds_scheduler, build_optimizer
from zerotron.parallel.data_parallel import DataParallel
from zerotron.pipeline import profile as step_profile
from zerotron.precision import MixedPrecisionOptimizer, make_loss_scaler
from zerotron.precision.grads import IsCounted, ReduceFn
from zerotron.precision.loss_scaler import LossScaler
from zerotron.zero import ZeroOptimizer, ZeroOptions
from zerotron.zero.optimizer import partition_model

if TYPE_CHECKING:
    from zerotron.config import Config
    from zerotron.config.sections import AutotuningConfig, FlopsProfilerConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def default_device() -> torch.device:
    """This process's CUDA device when there is one, else the CPU."""
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else (torch.device("cpu"))
    )


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


def build_torch_optimizer(params: Any, cfg: Config) -> torch.optim.Optimizer:
    """The config's optimizer (``optimizer`` section) over ``params`` (tensors or groups)."""
    o = cfg.optimizer
    return build_optimizer(
        params,
        o.optimizer,
        lr=o.lr if o.lr is not None else 0.0,  # --train-iters 0 may leave it unset
        weight_decay=o.weight_decay,
        betas=(o.adam_beta1, o.adam_beta2),
        eps=o.adam_eps,
        momentum=o.sgd_momentum,
        nesterov=o.sgd_nesterov,
        adam_w_mode=o.adam_w_mode,
        max_coeff=o.lamb_max_coeff,
        min_coeff=o.lamb_min_coeff,
    )


def build_scheduler(cfg: Config, optimizer: Any) -> Any:
    """The config's LR schedule over ``optimizer``: DeepSpeed's ``lr_scheduler_type`` (counted
    in iterations), else Megatron's warmup + decay (counted in samples) when the run has a
    length; None otherwise."""
    s, o = cfg.scheduler, cfg.optimizer
    if s.lr_scheduler_type is not None:
        return build_ds_scheduler(s.lr_scheduler_type, optimizer, s.lr_scheduler_params)
    if cfg.lr_decay_steps is None:
        return None
    return OptimizerParamScheduler(
        optimizer,
        max_lr=o.lr,
        min_lr=o.min_lr,
        lr_decay_steps=cfg.lr_decay_steps,
        lr_decay_style=s.lr_decay_style,
        lr_warmup_steps=cfg.lr_warmup_steps,
        init_lr=s.lr_warmup_init,
        start_wd=o.start_weight_decay,
        end_wd=o.end_weight_decay,
        wd_incr_steps=cfg.lr_decay_steps,
        wd_incr_style=o.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=s.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=s.override_opt_param_scheduler,
    )


@dataclass(frozen=True)
class OptimizerSetup:
    """How a torch optimizer is wrapped: loss scaling, clipping, data parallelism, ZeRO.

    ``bucket_size`` and ``reduce_in_fp32`` are the DataParallel buckets' (stage 0); with
    ZeRO (stages 1-3), ``zero`` is the ZeroOptimizer's options, built once from the config.
    """

    loss_scaler: LossScaler | None = None
    clip_grad: float = 0.0
    bucket_size: int | None = None
    reduce_in_fp32: bool = False
    zero: ZeroOptions | None = None

    @property
    def zero_stage(self) -> int:
        return self.zero.stage if self.zero is not None else 0

    @classmethod
    def from_config(cls, cfg: Config) -> OptimizerSetup:
        p = cfg.precision
        scaler = make_loss_scaler(
            DTYPES[p.params_dtype],
            loss_scale=p.loss_scale,
            initial_scale=p.initial_loss_scale,
            scale_window=p.loss_scale_window,
            hysteresis=p.hysteresis,
            consecutive_hysteresis=p.consecutive_hysteresis,
            min_scale=p.min_loss_scale,
            raise_error_at_min_scale=False,  # Megatron keeps going at the minimum scale
        )
        return cls(
            loss_scaler=scaler,
            clip_grad=cfg.optimizer.clip_grad,
            bucket_size=cfg.parallel.ddp_bucket_size,
            reduce_in_fp32=p.accumulate_allreduce_grads_in_fp32,
            zero=ZeroOptions.from_config(cfg.zero) if cfg.zero.zero_stage else None,
        )


def wrap_optimizer(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    setup: OptimizerSetup,
    ps: ParallelState | None = None,
) -> tuple[Any, Any]:
    """``(optimizer, data_parallel)`` for the Engine around a fresh torch ``optimizer`` over
    ``model``'s parameters (already in the training dtype); see the module docstring. Without
    an optimizer: a :class:`~zerotron.engine.optimizers.NoOptimizer` (forward passes only; at
    ZeRO stage 3 the model is partitioned all the same)."""
    ps = ps or state()
    if optimizer is None:  # forward passes only (DeepSpeed's engine without an optimizer)
        if setup.zero is not None and setup.zero_stage == 3:
            partition_model(model, setup.zero, ps.dp, where="initialize (no optimizer)")
        return NoOptimizer(setup.zero_stage, ps.dp), None
    reduce_fn, is_counted = grad_norm_hooks(ps)
    if setup.zero_stage == 0:
        data_parallel = None
        if ps.dp_size > 1:
            data_parallel = DataParallel(
                model.parameters(),
                ps.dp,
                bucket_size=setup.bucket_size,
                reduce_in_fp32=setup.reduce_in_fp32,
            )
        wrapped = MixedPrecisionOptimizer(
            optimizer,
            loss_scaler=setup.loss_scaler,
            clip_grad=setup.clip_grad,
            reduce_fn=reduce_fn,
            is_counted=is_counted,
        )
        return wrapped, data_parallel
    # Stage 3 partitions the model here (into the offload_param store when asked).
    wrapped = ZeroOptimizer(
        model,
        optimizer,
        setup.zero,
        group=ps.dp,
        loss_scaler=setup.loss_scaler,
        clip_grad=setup.clip_grad,
        reduce_fn=reduce_fn,
        is_counted=is_counted,
    )
    return wrapped, wrapped


def build_engine(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    setup: OptimizerSetup,
    *,
    ps: ParallelState | None = None,
    scheduler: Callable[[Any], Any] | None = None,
    autotuning: AutotuningConfig | None = None,
    flops_profiler: FlopsProfilerConfig | None = None,
    metrics: run_metrics.RunMetrics | None = None,
    profile_steps: str | None = None,
    profile_dir: str | None = None,
    **engine_options: Any,
) -> Engine:
    """An Engine training ``model`` with a fresh torch ``optimizer`` wrapped as ``setup`` says.

    ``scheduler(wrapped_optimizer)`` builds the LR schedule (None: no schedule);
    ``engine_options`` are the Engine's keyword arguments (``loss_fn``, ``micro_batch_size``,
    ``gradient_accumulation_steps``, ``pipeline``, ``checkpoint_metadata``, ``state_fitter``,
    ...), all but ``data_parallel``, which comes from the wrapping. ``autotuning``: the config's
    autotuning section; when enabled the run measures itself for ``zerotron tune``.
    ``flops_profiler``: the config's flops_profiler section; when enabled rank 0 prints the
    FLOPs profile of step ``profile_step`` (:mod:`zerotron.engine.flops_profiler`).
    ``metrics``: this rank's metrics-file writer (:mod:`zerotron.engine.run_metrics`), or None.
    ``profile_steps`` ("A:B"): record those steps' timeline into ``profile_dir``
    (:mod:`zerotron.pipeline.profile`).
    """
    wrapped, data_parallel = wrap_optimizer(model, optimizer, setup, ps)
    lr_scheduler = scheduler(wrapped) if scheduler is not None else None
    engine = Engine(model, wrapped, lr_scheduler, data_parallel=data_parallel, **engine_options)
    autotuning_metrics.attach(engine, autotuning)  # the config's "autotuning" block, if enabled
    flops_profiling.attach(engine, flops_profiler)  # its "flops_profiler" block, if enabled
    run_metrics.attach(engine, metrics)
    step_profile.attach(engine, profile_steps, profile_dir)  # --profile-steps, if given
    return engine
