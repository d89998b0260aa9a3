"""DeepSpeed's entry points: ``initialize``, ``add_config_arguments``, ``init_distributed``
(from :mod:`zerotron.compat.comm`).

A DeepSpeed training script runs on zerotron by changing its import::

    import zerotron as deepspeed

    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args()
    engine, optimizer, loader, scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=dataset
    )
    for batch in loader:
        loss = engine(batch)
        engine.backward(loss)
        engine.step()

:func:`initialize` does what ``deepspeed.initialize`` does, with zerotron's parts:

1. the config: ``config`` (a path, a JSON string or a dict; ``config_params`` is its old name)
   or ``args.deepspeed_config`` (``args.zerotron_config``), validated onto the schema by
   :mod:`zerotron.config.deepspeed` with ``"auto"`` values resolved from ``args``, the passed
   optimizer and the model; the resolved config is printed once, by rank 0;
2. processes: the default process group from the launcher's environment (a plain
   ``python train.py`` is rank 0 of a group of one: :func:`init_distributed`, which is
   ``deepspeed.comm.init_distributed``), and the tensor/pipeline/data-parallel groups:
   from a passed ``mpu`` (its sizes, checked against zerotron's rank layout) or zerotron's state;
3. the model: moved to the device and cast to fp16/bf16 when the config says so (with
   ``fp16.auto_cast`` its floating-point inputs are cast to fp16 too); where it holds zerotron's
   :class:`~zerotron.models.gpt.GPT`, the CPU kernel choices ``zerotron pretrain`` makes for it
   (:mod:`zerotron.kernels.chooser`: rank 0's cached or measured ones, for every rank; forced
   by ``ZEROTRON_KERNELS``), printed once by rank 0; the user's own layers run no zerotron
   kernels, so nothing is chosen for them;
4. the optimizer: passed (a torch optimizer, or a callable ``params -> optimizer``; it wins
   over the config's, as in DeepSpeed) or from the config's ``optimizer`` section, wrapped
   for precision and data parallelism by :func:`zerotron.engine.builder.build_engine`
   (stage 0: MixedPrecisionOptimizer + DataParallel; stages 1-3: ZeroOptimizer with the
   offload options), which assembles the Engine;
5. the scheduler: the config's ``scheduler`` section, else a passed scheduler (or callable
   ``optimizer -> scheduler``), stepped by the engine once per optimizer step;
6. ``training_data`` -> a DataLoader of micro-batches over a DistributedSampler of the
   data-parallel ranks (``collate_fn`` passed on).

Returns ``(engine, engine.optimizer, dataloader or None, engine.lr_scheduler)``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from zerotron.checkpoint.async_save import AsyncCheckpointWriter
from zerotron.compat.comm.comm import init_distributed
from zerotron.compat.runtime.dataloader import RepeatingLoader
from zerotron.errors import ConfigError, DistributedError

__all__ = ["add_config_arguments", "build_data_loader", "init_distributed", "initialize"]

CONFIG_ARGS = ("deepspeed_config", "zerotron_config")


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's arguments (and zerotron's names for them) to ``parser``; return it.

    ``--deepspeed`` / ``--zerotron`` (a switch scripts test), ``--deepspeed_config`` /
    ``--zerotron_config`` (the JSON file), and ``--local_rank`` (passed by launchers; the
    rank itself comes from the environment) unless the parser has it already.
    """
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument(
        "--deepspeed",
        default=False,
        action="store_true",
        help="enable the DeepSpeed-style engine (a switch for the script; zerotron always runs it)",
    )
    group.add_argument(
        "--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file"
    )
    group.add_argument("--zerotron", default=False, action="store_true", help="same as --deepspeed")
    group.add_argument(
        "--zerotron_config", default=None, type=str, help="same as --deepspeed_config"
    )
    known = getattr(parser, "_option_string_actions", {})
    names = [n for n in ("--local_rank", "--local-rank") if n not in known]
    if len(names) == 2:
        group.add_argument(
            *names,
            dest="local_rank",
            type=int,
            default=-1,
            help="local rank passed by launchers (zerotron reads LOCAL_RANK from the environment)",
        )
    return parser


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: Any = None,
    model_parameters: Iterable[Any] | None = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable | None = None,
    config: Any = None,
    config_params: Any = None,
) -> tuple[Any, Any, Any, Any]:
    """Build an :class:`~zerotron.engine.Engine` the way ``deepspeed.initialize`` builds its
    engine (see the module docstring); returns ``(engine, optimizer, dataloader,
    lr_scheduler)``."""
    from zerotron.config import AutoValues, format_resolved, load_deepspeed_config
    from zerotron.distributed.init import get_rank, get_world_size
    from zerotron.engine.builder import (
        DTYPES,
        OptimizerSetup,
        build_engine,
        build_torch_optimizer,
        default_device,
    )
    from zerotron.engine.monitors import MonitorMaster
    from zerotron.engine.run_metrics import from_config as metrics_from_config
    from zerotron.parallel.data_parallel import broadcast_parameters

    if model is None:
        raise ConfigError(
            "initialize() needs a model", where="initialize", fix="pass model=your_module"
        )
    source = _config_source(args, config, config_params)
    init_distributed(dist_init_required=dist_init_required)
    ps = _parallel_state(mpu)
    auto = AutoValues(
        args=args, optimizer_lr=_passed_lr(optimizer), hidden_size=_hidden_size(model)
    )
    cfg, resolved = load_deepspeed_config(
        source,
        world_size=get_world_size(),
        tensor_model_parallel_size=ps.tp_size,
        pipeline_model_parallel_size=ps.pp_size,
        auto=auto,
    )
    if get_rank() == 0:
        print(format_resolved(resolved), flush=True)
        for warning in cfg.warnings:
            print(f" WARNING: {warning}", flush=True)

    device = default_device()
    model.to(device=device, dtype=DTYPES[cfg.precision.params_dtype])
    # Every data-parallel replica (of each tensor/pipeline slice) starts from its rank 0's
    # weights, as in DeepSpeed, whatever seed each rank's script used.
    broadcast_parameters(model.parameters(), ps.dp)
    if cfg.precision.fp16 and cfg.precision.fp16_auto_cast:
        model.register_forward_pre_hook(_cast_inputs_half, with_kwargs=True)
    _configure_checkpointing(mpu, resolved)
    _choose_kernels(model, cfg, ps, device)

    params = _parameters(model, model_parameters)
    torch_optimizer = _torch_optimizer(optimizer, params, cfg, resolved, build_torch_optimizer)
    t = cfg.training
    pipeline = None
    if _is_pipeline_module(model):  # engine.train_batch(data_iter) runs DeepSpeed's 1F1B
        from zerotron.compat.pipe.stage import PipelineModuleRuntime

        pipeline = PipelineModuleRuntime(model, "1f1b", t.num_micro_batches)
    engine = build_engine(
        model,
        torch_optimizer,
        OptimizerSetup.from_config(cfg),
        ps=ps,
        scheduler=None
        if torch_optimizer is None
        else lambda wrapped: _scheduler(cfg, wrapped, lr_scheduler),
        micro_batch_size=t.micro_batch_size,
        gradient_accumulation_steps=t.num_micro_batches,
        data_parallel_size=ps.dp_size,
        pipeline=pipeline,
        wall_clock_breakdown=cfg.monitor.wall_clock_breakdown,
        steps_per_print=t.log_interval,
        device=device,
        monitor=MonitorMaster.from_config(cfg.monitor, get_rank()),
        checkpoint_tag_validation=cfg.checkpoint.checkpoint_tag_validation,
        autotuning=cfg.autotuning,
        flops_profiler=cfg.flops_profiler,
        metrics=metrics_from_config(cfg, get_rank(), config=resolved),  # "metrics_dir"
        profile_steps=cfg.monitor.profile_steps,
        profile_dir=cfg.monitor.profile_dir or cfg.training.metrics_dir,
    )
    # checkpoint.keep_last (zerotron's) and checkpoint.writer.decoupled (a background writer)
    engine.checkpoint_keep_last = cfg.checkpoint.save_keep_last
    engine.checkpoint_writer = AsyncCheckpointWriter() if cfg.checkpoint.async_save else None
    engine.load_universal = cfg.checkpoint.load_universal  # DeepSpeed's universal checkpoints
    engine.config = resolved  # DeepSpeed's engine.config: the config dict (HF's Trainer reads it)
    loader = None
    if training_data is not None:
        loader = build_data_loader(training_data, t.micro_batch_size, ps, collate_fn, t.seed)
        engine.training_dataloader = loader
    if training_data is not None and pipeline is not None:
        # engine.train_batch() without data_iter: DeepSpeed's pipeline engine draws from the
        # training data in order (no shuffling), starting over at its end.
        ordered = build_data_loader(
            training_data, t.micro_batch_size, ps, collate_fn, t.seed, shuffle=False
        )
        engine.set_dataloader(RepeatingLoader(ordered))
    return engine, engine.optimizer, loader, engine.lr_scheduler


def _scheduler(cfg: Any, wrapped: Any, lr_scheduler: Any) -> Any:
    """The config's ``scheduler`` section over the wrapped optimizer (it wins, as in
    DeepSpeed), else the passed scheduler or callable ``optimizer -> scheduler``."""
    from zerotron.optim import build_ds_scheduler

    s = cfg.scheduler
    if s.lr_scheduler_type is not None:
        return build_ds_scheduler(s.lr_scheduler_type, wrapped, s.lr_scheduler_params)
    if lr_scheduler is not None and not hasattr(lr_scheduler, "step") and callable(lr_scheduler):
        # DeepSpeed hands the callable its basic (torch) optimizer
        return _TorchSchedule.wrap(lr_scheduler(getattr(wrapped, "optimizer", wrapped)))
    _check_scheduler_groups(lr_scheduler, getattr(wrapped, "optimizer", wrapped))
    return _TorchSchedule.wrap(lr_scheduler)


def _check_scheduler_groups(scheduler: Any, optimizer: Any) -> None:
    """Refuse a torch scheduler built over more or fewer param groups than the wrapped torch
    optimizer now has: ZeRO gives each sub-group of ``sub_group_size`` elements a group of its
    own, so a group larger than that becomes several (the scheduler would fail at its step)."""
    base_lrs = getattr(scheduler, "base_lrs", None)
    groups = getattr(optimizer, "param_groups", None)
    if base_lrs is None or groups is None or len(base_lrs) == len(groups):
        return
    raise ConfigError(
        f"the LR scheduler was built over {len(base_lrs)} param groups, but ZeRO steps "
        f"{len(groups)}: zero_optimization.sub_group_size splits a group into pieces",
        where="initialize(lr_scheduler=...)",
        fix="raise zero_optimization.sub_group_size above the largest group's elements per "
        'rank, or pass lr_scheduler as a callable (optimizer -> scheduler), or use the "scheduler" '
        "section of the config",
    )


def build_data_loader(
    dataset: Any,
    micro_batch_size: int,
    ps: Any,
    collate_fn: Callable | None,
    seed: int,
    shuffle: bool = True,
) -> torch.utils.data.DataLoader:
    """Micro-batches of ``dataset`` for this data-parallel rank (DeepSpeed's
    ``deepspeed_io``): a DistributedSampler over the data-parallel ranks."""
    from torch.utils.data import DataLoader, DistributedSampler

    sampler = DistributedSampler(
        dataset, num_replicas=ps.dp_size, rank=ps.dp_rank, shuffle=shuffle, seed=seed
    )
    return DataLoader(dataset, batch_size=micro_batch_size, sampler=sampler, collate_fn=collate_fn)


class _TorchSchedule:
    """A torch LR scheduler under the Engine's ``step(increment)`` (torch's own ``step``
    argument is a deprecated epoch number, not an increment)."""

    def __init__(self, scheduler: Any):
        self.scheduler = scheduler

    @classmethod
    def wrap(cls, scheduler: Any) -> Any:
        if scheduler is None or not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
            return scheduler
        return cls(scheduler)

    def step(self, increment: int = 1) -> None:
        for _ in range(increment):
            self.scheduler.step()

    def get_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    get_last_lr = get_lr

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.scheduler, name)


# --------------------------------------------------------------------------------------------
# helpers


def _config_source(args: Any, config: Any, config_params: Any) -> Any:
    if config is not None and config_params is not None:
        raise ConfigError(
            "both config and config_params are given",
            where="initialize",
            fix="pass one of them (config_params is config's older name)",
        )
    config = config if config is not None else config_params
    from_args = [getattr(args, n, None) for n in CONFIG_ARGS if getattr(args, n, None)]
    if config is not None and from_args:
        raise ConfigError(
            f"a config is given both to initialize(config=...) and in args ({from_args[0]!r})",
            where="initialize",
            fix="pass one of them (DeepSpeed refuses this too)",
        )
    if config is None and from_args:
        config = from_args[0]
    if config is None:
        raise ConfigError(
            "no DeepSpeed config",
            where="initialize",
            fix="pass config=dict_or_path, or --deepspeed_config ds.json with "
            "add_config_arguments(parser)",
        )
    return config


def _parallel_state(mpu: Any) -> Any:
    """zerotron's ParallelState, laid out as ``mpu`` says when one is passed."""
    from zerotron.distributed import mpu as own_mpu
    from zerotron.distributed.init import get_world_size
    from zerotron.distributed.state import (
        initialize_model_parallel,
        is_model_parallel_initialized,
        state,
    )

    if mpu is None or mpu is own_mpu:
        return state()
    tp = _call(mpu, "get_tensor_model_parallel_world_size", "get_slice_parallel_world_size")
    if tp is None:
        tp = _call(mpu, "get_model_parallel_world_size") or 1
    pp = _call(mpu, "get_pipeline_model_parallel_world_size", "get_pipe_parallel_world_size") or 1
    if get_world_size() > 1 and not is_model_parallel_initialized():
        initialize_model_parallel(tp, pp)
    ps = state()
    dp_size = _call(mpu, "get_data_parallel_world_size")
    dp_rank = _call(mpu, "get_data_parallel_rank")
    if (dp_size, dp_rank) != (ps.dp_size, ps.dp_rank) and dp_size is not None:
        raise DistributedError(
            f"the mpu puts this rank at data-parallel rank {dp_rank} of {dp_size}, zerotron's "
            f"layout (tensor fastest, then data, then pipeline) at {ps.dp_rank} of {ps.dp_size}",
            where="initialize(mpu=...)",
            fix="build the mpu's groups in Megatron's order, or pass zerotron.distributed.mpu",
        )
    return ps


def _is_pipeline_module(model: nn.Module) -> bool:
    from zerotron.compat.pipe import PipelineModule

    return isinstance(model, PipelineModule)


def _call(obj: Any, *names: str) -> Any:
    for name in names:
        fn = getattr(obj, name, None)
        if callable(fn):
            return fn()
    return None


def _passed_lr(optimizer: Any) -> float | None:
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer.param_groups[0]["lr"]
    return None


def _choose_kernels(model: nn.Module, cfg: Any, ps: Any, device: torch.device) -> None:
    """The kernel choices for the first zerotron GPT in ``model``, as ``zerotron pretrain``
    makes them (one tensor-parallel rank's shapes, rank 0 deciding for the job)."""
    from zerotron.distributed import comm
    from zerotron.kernels import KernelShape, choose_kernels
    from zerotron.models.gpt import GPT

    gpt = next((m for m in model.modules() if isinstance(m, GPT)), None)
    if gpt is None:
        return
    c = gpt.config
    shape = KernelShape(
        hidden=c.hidden_size,
        heads=c.num_attention_heads,
        seq=c.seq_length,
        micro_batch=cfg.training.micro_batch_size,
        vocab=c.orig_vocab_size or c.vocab_size,
        dtype=cfg.precision.params_dtype,
        tp=ps.tp_size,
    )
    group = comm.world_group()
    chosen = choose_kernels(shape, device, group=group)
    if group.rank == 0:
        print(f" {chosen.line()}", flush=True)


def _hidden_size(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    for name in ("hidden_size", "n_embd", "d_model"):
        value = getattr(config, name, None) if config is not None else None
        if isinstance(value, int):
            return value
    return None


def _parameters(model: nn.Module, model_parameters: Iterable[Any] | None) -> list[Any]:
    """What the optimizer is built over: ``model_parameters`` (tensors or groups), read once."""
    if model_parameters is None:
        return [p for p in model.parameters() if p.requires_grad]
    params = list(model_parameters)
    if params and not isinstance(params[0], Mapping):
        params = [p for p in params if p.requires_grad]
    return params


def _torch_optimizer(
    optimizer: Any,
    params: list[Any],
    cfg: Any,
    resolved: Mapping[str, Any],
    build: Callable,
) -> torch.optim.Optimizer | None:
    from zerotron.distributed.init import get_rank

    in_config = "optimizer" in resolved
    if optimizer is None:
        # Neither: an engine for forward passes only (an RLHF reference or reward model,
        # evaluation), as DeepSpeed builds; its backward and step say what is missing.
        return build(params, cfg) if in_config else None
    if in_config and get_rank() == 0:  # DeepSpeed: the passed one wins
        print(
            " WARNING: an optimizer was passed to initialize(); the config's 'optimizer' "
            "section is ignored",
            flush=True,
        )
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    if callable(optimizer):
        return optimizer(params)
    raise ConfigError(
        f"optimizer must be a torch optimizer or a callable(params), got "
        f"{type(optimizer).__name__}",
        where="initialize(optimizer=...)",
    )


def _half(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.half() if value.is_floating_point() else value
    if isinstance(value, Mapping):
        return {k: _half(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_half(v) for v in value)
    return value


def _cast_inputs_half(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """fp16.auto_cast: floating-point inputs of the model's forward become fp16 (DeepSpeed's
    ``_cast_inputs_half``)."""
    return _half(args), _half(kwargs)


def _configure_checkpointing(mpu: Any, resolved: Mapping[str, Any]) -> None:
    """DeepSpeed configures activation checkpointing from the config's section."""
    if not resolved.get("activation_checkpointing"):
        return
    from zerotron.compat import checkpointing

    checkpointing.configure(mpu, deepspeed_config=dict(resolved))
