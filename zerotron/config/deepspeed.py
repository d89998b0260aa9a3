"""DeepSpeed's JSON config onto the one schema (:class:`~zerotron.config.schema.Config`).

    cfg, resolved = load_deepspeed_config("ds.json", world_size=4)
    cfg.zero.zero_stage, cfg.training.num_micro_batches, cfg.optimizer.lr

Every key DeepSpeed documents for what zerotron implements maps onto a schema field (the table
is :data:`SPEC`; docs/deepspeed.md lists it), with DeepSpeed's meaning and defaults:

- ``train_batch_size`` / ``train_micro_batch_size_per_gpu`` / ``gradient_accumulation_steps``
  -> ``global_batch_size`` / ``micro_batch_size`` / ``num_micro_batches``: any two give the
  third, with DP = world / (tp · pp); three that disagree are an error showing the arithmetic.
- ``fp16.initial_scale_power`` p -> ``initial_loss_scale`` 2**p; ``fp16.loss_scale`` 0 (dynamic)
  -> ``loss_scale`` None; ``gradient_clipping`` -> ``clip_grad``; ``steps_per_print`` ->
  ``log_interval``; ``optimizer.params`` -> ``lr``, ``adam_beta1/2``, ``adam_eps``, ...;
  ``scheduler`` -> ``lr_scheduler_type`` / ``lr_scheduler_params``; ``zero_optimization.X`` ->
  ``zero_stage`` and the fields of the ``zero`` section (``offload_optimizer.device`` ->
  ``offload_optimizer_device``); ``tensorboard.enabled`` -> ``tensorboard_enabled``, ...
- Where DeepSpeed's default differs from Megatron's (gradient clipping 0, steps_per_print 10,
  initial scale 2**16, Adam weight decay 0), a DeepSpeed config gets DeepSpeed's.

``"auto"`` (as Hugging Face writes these configs) is resolved from what the caller knows
(:class:`AutoValues`: the script's ``args``, a passed optimizer's learning rate, the model's
hidden size) and otherwise takes DeepSpeed's default; the resolved dict comes back for printing.

A value of the wrong type names its key path (``zero_optimization.offload_optimizer.device:
'gpu' is not one of none, cpu, nvme``); an unknown key is a warning (``Config.warnings``) with
the closest known key; a DeepSpeed feature zerotron does not implement (OneBitAdam, curriculum
learning, compression, ...) raises :class:`~zerotron.errors.UnsupportedError` saying so.
"""

from __future__ import annotations

import copy
import difflib
import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from zerotron.config.files import read_config_file
from zerotron.config.schema import Config
from zerotron.config.sections import FIELD_SECTION
from zerotron.errors import ConfigError, UnsupportedError

AUTO = "auto"

BATCH_FIELDS = {
    "global_batch_size": "train_batch_size",
    "micro_batch_size": "train_micro_batch_size_per_gpu",
    "num_micro_batches": "gradient_accumulation_steps",
}

# --------------------------------------------------------------------------------------------
# Value parsers: (path, value) -> value, raising ConfigError that names the path.

Parse = Callable[[str, Any], Any]


def _bad(path: str, value: Any, expected: str) -> ConfigError:
    return ConfigError(f"{path}: {value!r} is not {expected}", fix="correct the value")


def INT(path: str, value: Any) -> int:
    """An integer; 5e8 and "5e8" are accepted (DeepSpeed configs write bucket sizes so)."""
    if isinstance(value, bool):
        raise _bad(path, value, "an integer")
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise _bad(path, value, "an integer") from None
    if isinstance(value, float):
        if not (math.isfinite(value) and value.is_integer()):
            raise _bad(path, value, "an integer")
        return int(value)
    if not isinstance(value, int):
        raise _bad(path, value, "an integer")
    return value


def FLOAT(path: str, value: Any) -> float:
    if isinstance(value, bool):
        raise _bad(path, value, "a number")
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            raise _bad(path, value, "a number") from None
    if not isinstance(value, (int, float)):
        raise _bad(path, value, "a number")
    return float(value)


def BOOL(path: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _bad(path, value, "true or false")
    return value


def STR(path: str, value: Any) -> str:
    if not isinstance(value, str):
        raise _bad(path, value, "a string")
    return value


def OPT_STR(path: str, value: Any) -> str | None:
    return None if value is None else STR(path, value)


def CHOICE(*choices: str, fold: bool = True) -> Parse:
    """One of ``choices`` (case-insensitively when ``fold``), returned in its canonical case."""

    def parse(path: str, value: Any) -> str:
        if isinstance(value, str):
            for c in choices:
                if value == c or (fold and value.lower() == c.lower()):
                    return c
        raise _bad(path, value, f"one of {', '.join(choices)}")

    return parse


def POSITIVE(parse: Parse) -> Parse:
    def check(path: str, value: Any) -> Any:
        value = parse(path, value)
        if value <= 0:
            raise _bad(path, value, "positive")
        return value

    return check


def NON_NEGATIVE(parse: Parse) -> Parse:
    def check(path: str, value: Any) -> Any:
        value = parse(path, value)
        if value < 0:
            raise _bad(path, value, "zero or positive")
        return value

    return check


def BETAS(path: str, value: Any) -> tuple[float, float]:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise _bad(path, value, "a pair [beta1, beta2]")
    return FLOAT(f"{path}[0]", value[0]), FLOAT(f"{path}[1]", value[1])


# --------------------------------------------------------------------------------------------
# The table: DeepSpeed key -> schema field.


class Leaf(NamedTuple):
    """A DeepSpeed key that sets schema ``field`` to ``to_field(parse(value))``."""

    field: str
    parse: Parse
    default: Any = None
    """DeepSpeed's default, for "auto" (None: no default; "auto" needs to be resolved)"""
    to_field: Callable[[Any], Any] | None = None


class Ignored(NamedTuple):
    """A DeepSpeed key zerotron accepts and does nothing with (``why``: a warning; '' silent)."""

    why: str = ""


class Refused(NamedTuple):
    """A DeepSpeed feature zerotron does not implement; ``harmless(value)`` lets it pass."""

    why: str
    harmless: Callable[[Any], bool] = lambda v: v in (None, False, 0, "") or _disabled(v)


def _disabled(value: Any) -> bool:
    return isinstance(value, Mapping) and not value.get("enabled", False)


def _loss_scale(value: float) -> float | None:
    return None if value == 0 else value  # DeepSpeed: 0 means dynamic scaling


def _offload(kind: str) -> dict[str, Any]:
    prefix = f"offload_{kind}_"
    node: dict[str, Any] = {
        "device": Leaf(prefix + "device", CHOICE("none", "cpu", "nvme"), "none"),
        "nvme_path": Leaf(prefix + "nvme_path", OPT_STR, None),
        "pin_memory": Leaf(prefix + "pin_memory", BOOL, False),
        "buffer_count": Leaf(
            prefix + "buffer_count", POSITIVE(INT), 4 if kind == "optimizer" else 5
        ),
    }
    if kind == "param":
        node["buffer_size"] = Leaf(prefix + "buffer_size", POSITIVE(INT), 100_000_000)
        node["max_in_cpu"] = Leaf(prefix + "max_in_cpu", NON_NEGATIVE(INT), 1_000_000_000)
    else:
        node["pipeline_read"] = Ignored("NVMe reads and writes are not overlapped with the step")
        node["pipeline_write"] = Ignored("NVMe reads and writes are not overlapped with the step")
        node["pipeline"] = Ignored("NVMe reads and writes are not overlapped with the step")
        node["fast_init"] = Ignored("")
        node["ratio"] = Refused(
            "partial optimizer offload (ratio < 1) is not implemented; the whole optimizer "
            "state is offloaded",
            lambda v: v in (None, 1, 1.0),
        )
    return node


def _stage(path: str, value: Any) -> int:
    stage = INT(path, value)
    if stage not in (0, 1, 2, 3):
        raise _bad(path, value, "one of 0, 1, 2, 3")
    return stage


_ZERO: dict[str, Any] = {
    "stage": Leaf("zero_stage", _stage, 0),
    "allgather_partitions": Leaf("allgather_partitions", BOOL, True),
    "allgather_bucket_size": Leaf("allgather_bucket_size", POSITIVE(INT), 500_000_000),
    "overlap_comm": Leaf("overlap_comm", BOOL, None),
    "reduce_scatter": Leaf("reduce_scatter", BOOL, True),
    "reduce_bucket_size": Leaf("reduce_bucket_size", POSITIVE(INT), 500_000_000),
    "contiguous_gradients": Leaf("contiguous_gradients", BOOL, True),
    "round_robin_gradients": Leaf("round_robin_gradients", BOOL, False),
    "offload_optimizer": _offload("optimizer"),
    "offload_param": _offload("param"),
    "sub_group_size": Leaf("sub_group_size", NON_NEGATIVE(INT), 1_000_000_000),
    "stage3_prefetch_bucket_size": Leaf(
        "stage3_prefetch_bucket_size", NON_NEGATIVE(INT), 50_000_000
    ),
    "stage3_param_persistence_threshold": Leaf(
        "stage3_param_persistence_threshold", NON_NEGATIVE(INT), 100_000
    ),
    "stage3_max_live_parameters": Leaf(
        "stage3_max_live_parameters", NON_NEGATIVE(INT), 1_000_000_000
    ),
    "stage3_max_reuse_distance": Leaf(
        "stage3_max_reuse_distance", NON_NEGATIVE(INT), 1_000_000_000
    ),
    "stage3_gather_16bit_weights_on_model_save": Leaf(
        "stage3_gather_16bit_weights_on_model_save", BOOL, False
    ),
    "stage3_gather_fp16_weights_on_model_save": Leaf(  # DeepSpeed's older name
        "stage3_gather_16bit_weights_on_model_save", BOOL, False
    ),
    "cpu_offload": Leaf(  # DeepSpeed's older switch for offload_optimizer.device cpu
        "offload_optimizer_device", BOOL, False, lambda on: "cpu" if on else "none"
    ),
    "load_from_fp32_weights": Ignored(""),
    "ignore_unused_parameters": Ignored(""),
    "elastic_checkpoint": Ignored("checkpoints load only on the data-parallel size they had"),
    "stage3_model_persistence_threshold": Ignored(""),
    "memory_efficient_linear": Ignored(""),
    "use_multi_rank_bucket_allreduce": Ignored(""),
    "legacy_stage1": Refused("DeepSpeed's legacy stage 1 is not implemented; use stage 1"),
    "zero_quantized_weights": Refused("quantized ZeRO weights (ZeRO++) are not implemented"),
    "zero_quantized_nontrainable_weights": Refused(
        "quantized ZeRO weights (ZeRO++) are not implemented"
    ),
    "zero_quantized_gradients": Refused("quantized ZeRO gradients (ZeRO++) are not implemented"),
    "zero_hpz_partition_size": Refused(
        "hierarchical partitioning (ZeRO++ hpZ) is not implemented", lambda v: v in (None, 1)
    ),
    "mics_shard_size": Refused("MiCS is not implemented", lambda v: v in (None, -1, 0)),
    "mics_hierarchical_params_gather": Refused("MiCS is not implemented"),
    "offload_states": Refused("offloading states between steps is not implemented"),
}

_MONITOR_JOB = "DeepSpeedJobName"

SPEC: dict[str, Any] = {
    # batch (resolved together, see _resolve_batch)
    "train_batch_size": Leaf("global_batch_size", POSITIVE(INT)),
    "train_micro_batch_size_per_gpu": Leaf("micro_batch_size", POSITIVE(INT)),
    "gradient_accumulation_steps": Leaf("num_micro_batches", POSITIVE(INT)),
    "steps_per_print": Leaf("log_interval", POSITIVE(INT), 10),
    "seed": Leaf("seed", NON_NEGATIVE(INT), 1234),
    "gradient_clipping": Leaf("clip_grad", NON_NEGATIVE(FLOAT), 0.0),
    "prescale_gradients": Leaf("prescale_gradients", BOOL, False),
    "gradient_predivide_factor": Leaf("gradient_predivide_factor", POSITIVE(FLOAT), 1.0),
    "communication_data_type": Leaf(
        "communication_data_type",
        lambda p, v: None if v is None else _comm_dtype(p, v),
        None,
    ),
    "zero_force_ds_cpu_optimizer": Leaf("zero_force_ds_cpu_optimizer", BOOL, True),
    "wall_clock_breakdown": Leaf("wall_clock_breakdown", BOOL, False),
    "fp16": {
        "enabled": Leaf("fp16", BOOL, False),
        "auto_cast": Leaf("fp16_auto_cast", BOOL, False),
        "loss_scale": Leaf("loss_scale", NON_NEGATIVE(FLOAT), 0.0, _loss_scale),
        "initial_scale_power": Leaf("initial_loss_scale", NON_NEGATIVE(INT), 16, lambda p: 2.0**p),
        "loss_scale_window": Leaf("loss_scale_window", POSITIVE(INT), 1000),
        "hysteresis": Leaf("hysteresis", POSITIVE(INT), 2),
        "consecutive_hysteresis": Leaf("consecutive_hysteresis", BOOL, False),
        "min_loss_scale": Leaf("min_loss_scale", POSITIVE(FLOAT), 1.0),
        "fp16_master_weights_and_grads": Refused(
            "fp16 master weights are not implemented: masters are always fp32"
        ),
    },
    "bf16": {
        "enabled": Leaf("bf16", BOOL, False),
        "immediate_grad_update": Ignored(""),
        "check_grad_overflow": Ignored("bf16 steps are never skipped"),
        "bf16_master_weights_and_grads": Refused(
            "bf16 master weights are not implemented: masters are always fp32"
        ),
    },
    "zero_optimization": _ZERO,
    "activation_checkpointing": {
        "partition_activations": Leaf("partition_activations", BOOL, False),
        "cpu_checkpointing": Leaf("cpu_checkpointing", BOOL, False),
        "contiguous_memory_optimization": Leaf("contiguous_memory_optimization", BOOL, False),
        "number_checkpoints": Leaf(
            "number_checkpoints", lambda p, v: None if v is None else POSITIVE(INT)(p, v), None
        ),
        "synchronize_checkpoint_boundary": Leaf("synchronize_checkpoint_boundary", BOOL, False),
        "profile": Leaf("checkpointing_profile", BOOL, False),
    },
    "tensorboard": {
        "enabled": Leaf("tensorboard_enabled", BOOL, False),
        "output_path": Leaf("tensorboard_output_path", STR, ""),
        "job_name": Leaf("tensorboard_job_name", STR, _MONITOR_JOB),
    },
    "wandb": {
        "enabled": Leaf("wandb_enabled", BOOL, False),
        "group": Leaf("wandb_group", OPT_STR, None),
        "team": Leaf("wandb_team", OPT_STR, None),
        "project": Leaf("wandb_project", STR, "deepspeed"),
    },
    "csv_monitor": {
        "enabled": Leaf("csv_monitor_enabled", BOOL, False),
        "output_path": Leaf("csv_monitor_output_path", STR, ""),
        "job_name": Leaf("csv_monitor_job_name", STR, _MONITOR_JOB),
    },
    "checkpoint": {
        "use_node_local_storage": Leaf("use_node_local_storage", BOOL, False),
        "tag_validation": Leaf(
            "checkpoint_tag_validation", CHOICE("Ignore", "Warn", "Fail"), "Warn"
        ),
        "load_universal": Refused("universal checkpoints are not implemented"),
        "parallel_write": Ignored("checkpoint files are written by one rank each"),
    },
    # accepted, no effect
    "zero_allow_untested_optimizer": Ignored(""),
    "memory_breakdown": Ignored("memory is not broken down per step"),
    "dump_state": Ignored(""),
    "disable_allgather": Ignored(""),
    "comms_logger": Ignored("every collective is recorded in zerotron.distributed.comm.ledger"),
    "aio": Ignored(""),  # NVMe I/O tuning: the offload layer picks its own
    "pipeline": Ignored(""),  # zerotron.pipe.PipelineModule takes its options as arguments
    "data_types": Ignored("gradients accumulate in fp32"),
    "gradient_accumulation_dtype": Ignored("gradients accumulate in fp32"),
    # known, not implemented
    "amp": Refused("apex AMP is not supported; use fp16 or bf16"),
    "torch_autocast": Refused("torch autocast is not supported; use fp16 or bf16"),
    "fp8": Refused("FP8 training is not implemented; use fp16 or bf16"),
    "sparse_gradients": Refused("sparse gradients are not implemented"),
    "compression_training": Refused("DeepSpeed Compression is not implemented", lambda v: not v),
    "curriculum_learning": Refused("curriculum learning is not implemented"),
    "data_efficiency": Refused("DeepSpeed Data Efficiency is not implemented"),
    "sparse_attention": Refused("sparse attention is not implemented", lambda v: not v),
    "elasticity": Refused("elastic training is not implemented"),
    "autotuning": Refused("DeepSpeed's autotuner is not supported"),
    "flops_profiler": Refused("the flops profiler is not implemented"),
    "quantize_training": Refused("quantization-aware training is not implemented"),
    "eigenvalue": Refused("eigenvalue computation is not implemented"),
    "progressive_layer_drop": Refused("progressive layer dropping is not implemented"),
    "hybrid_engine": Refused("the hybrid (RLHF) engine is not implemented"),
    "nebula": Refused("Nebula checkpointing is not implemented"),
    "weight_quantization": Refused("weight quantization is not implemented", lambda v: not v),
    "sequence_parallel_size": Refused(
        "Ulysses sequence parallelism is not implemented; use tensor parallelism with "
        "sequence parallelism",
        lambda v: v in (None, 1),
    ),
    "tensor_parallel": Refused(
        "DeepSpeed's AutoTP is not implemented; build the model with zerotron's "
        "tensor-parallel layers",
        lambda v: not v or (isinstance(v, Mapping) and v.get("autotp_size", 1) in (0, 1)),
    ),
    "compile": Refused("DeepSpeed's compile backend is not supported", _disabled),
}
"""DeepSpeed's keys: a dict is a section, a Leaf sets a schema field. ``optimizer`` and
``scheduler`` are read by :func:`_optimizer` and :func:`_scheduler`."""

SPEC["bfloat16"] = SPEC["bf16"]  # DeepSpeed accepts both spellings


def _comm_dtype(path: str, value: Any) -> str:
    names = {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16", "bfp16": "bf16", "float32": "fp32"}
    if isinstance(value, str) and value.lower() in names:
        return names[value.lower()]
    raise _bad(path, value, "one of fp32, fp16, bf16")


# Optimizers. DeepSpeed lower-cases the type; "Adam" is AdamW unless adam_w_mode is false.
OPTIMIZERS = {"adam": "adam", "adamw": "adamw", "sgd": "sgd", "lamb": "lamb"}
UNSUPPORTED_OPTIMIZERS = {
    "onebitadam": "OneBitAdam",
    "zerooneadam": "ZeroOneAdam",
    "onebitlamb": "OneBitLamb",
    "adagrad": "Adagrad",
    "lion": "Lion",
    "muadam": "MuAdam",
    "muadamw": "MuAdamW",
    "musgd": "MuSGD",
}

_ADAM_PARAMS: dict[str, Any] = {
    "lr": Leaf("lr", NON_NEGATIVE(FLOAT), 1e-3),
    "betas": Leaf("betas", BETAS, (0.9, 0.999)),
    "eps": Leaf("adam_eps", POSITIVE(FLOAT), 1e-8),
    "weight_decay": Leaf("weight_decay", NON_NEGATIVE(FLOAT), 0.0),
    "adam_w_mode": Leaf("adam_w_mode", BOOL, True),
    "bias_correction": Refused(
        "Adam without bias correction is not implemented", lambda v: v in (None, True)
    ),
    "amsgrad": Refused("AMSGrad is not implemented", lambda v: v in (None, False)),
    "torch_adam": Ignored(""),
    "fused": Ignored(""),
}
OPTIMIZER_PARAMS: dict[str, dict[str, Any]] = {
    "adam": _ADAM_PARAMS,
    "adamw": _ADAM_PARAMS,
    "lamb": {
        **{k: _ADAM_PARAMS[k] for k in ("lr", "betas", "eps", "weight_decay", "bias_correction")},
        "max_coeff": Leaf("lamb_max_coeff", POSITIVE(FLOAT), 10.0),
        "min_coeff": Leaf("lamb_min_coeff", NON_NEGATIVE(FLOAT), 0.01),
        "max_grad_norm": Ignored("use gradient_clipping"),
    },
    "sgd": {
        "lr": Leaf("lr", NON_NEGATIVE(FLOAT), 1e-3),
        "momentum": Leaf("sgd_momentum", NON_NEGATIVE(FLOAT), 0.0),
        "weight_decay": Leaf("weight_decay", NON_NEGATIVE(FLOAT), 0.0),
        "nesterov": Leaf("sgd_nesterov", BOOL, False),
        "dampening": Refused("SGD dampening is not implemented", lambda v: v in (None, 0)),
    },
}

# Schedulers: type -> parameter -> (parse, default); a default of REQUIRED must be given.
REQUIRED = object()
_WARMUP = {
    "warmup_min_lr": (NON_NEGATIVE(FLOAT), 0.0),
    "warmup_max_lr": (NON_NEGATIVE(FLOAT), 1e-3),
    "warmup_num_steps": (POSITIVE(INT), 1000),
    "warmup_type": (CHOICE("log", "linear"), "log"),
}
SCHEDULER_PARAMS: dict[str, dict[str, tuple[Parse, Any]]] = {
    "WarmupLR": _WARMUP,
    "WarmupDecayLR": {"total_num_steps": (POSITIVE(INT), REQUIRED), **_WARMUP},
    "WarmupCosineLR": {
        "total_num_steps": (POSITIVE(INT), REQUIRED),
        "warmup_min_ratio": (NON_NEGATIVE(FLOAT), 0.0),
        "warmup_num_steps": (POSITIVE(INT), 1000),
        "cos_min_ratio": (NON_NEGATIVE(FLOAT), 0.0001),
        "warmup_type": (CHOICE("log", "linear"), "log"),
    },
    "OneCycle": {
        "cycle_min_lr": (NON_NEGATIVE(FLOAT), REQUIRED),
        "cycle_max_lr": (NON_NEGATIVE(FLOAT), REQUIRED),
        "decay_lr_rate": (NON_NEGATIVE(FLOAT), 0.0),
        "cycle_first_step_size": (POSITIVE(INT), 2000),
        "cycle_second_step_size": (lambda p, v: None if v is None else POSITIVE(INT)(p, v), None),
        "cycle_first_stair_count": (NON_NEGATIVE(INT), 0),
        "cycle_second_stair_count": (
            lambda p, v: None if v is None else NON_NEGATIVE(INT)(p, v),
            None,
        ),
        "decay_step_size": (NON_NEGATIVE(INT), 0),
        "cycle_momentum": (BOOL, True),
        "cycle_min_mom": (NON_NEGATIVE(FLOAT), 0.8),
        "cycle_max_mom": (NON_NEGATIVE(FLOAT), 0.9),
        "decay_mom_rate": (NON_NEGATIVE(FLOAT), 0.0),
    },
    "LRRangeTest": {
        "lr_range_test_min_lr": (NON_NEGATIVE(FLOAT), 1e-3),
        "lr_range_test_step_size": (POSITIVE(INT), 2000),
        "lr_range_test_step_rate": (NON_NEGATIVE(FLOAT), 1.0),
        "lr_range_test_staircase": (BOOL, False),
    },
}
"""DeepSpeed's schedulers and their parameters, with DeepSpeed's defaults."""

UNSUPPORTED_SCHEDULERS = ("OneCycleLR", "CosineAnnealingLR")

# --------------------------------------------------------------------------------------------
# "auto"


@dataclass
class AutoValues:
    """What ``"auto"`` values resolve from (Hugging Face's conventions where they exist).

    ``args`` is the script's namespace: its ``train_micro_batch_size_per_gpu`` /
    ``per_device_train_batch_size`` / ``micro_batch_size`` / ``batch_size``,
    ``gradient_accumulation_steps``, ``train_batch_size``, ``lr`` / ``learning_rate``,
    ``weight_decay``, ``adam_beta1``/``adam_beta2``, ``adam_eps``/``adam_epsilon``,
    ``clip_grad``/``max_grad_norm``, ``fp16``/``bf16``, ``warmup_steps``/``warmup_num_steps``,
    ``train_iters``/``total_num_steps``/``max_steps`` are used when present.
    ``optimizer_lr`` is a passed optimizer's learning rate; ``hidden_size`` the model's (for
    the bucket sizes Hugging Face derives from it).
    """

    args: Any = None
    optimizer_lr: float | None = None
    hidden_size: int | None = None

    def arg(self, *names: str) -> Any:
        for name in names:
            value = getattr(self.args, name, None) if self.args is not None else None
            if value is not None:
                return value
        return None


def _auto_leaf(path: str, leaf: Leaf, auto: AutoValues) -> Any:
    """The value "auto" stands for at ``path`` (None: leave the key out)."""
    h = auto.hidden_size
    name = path.rsplit(".", 1)[-1]
    by_arg = {
        "train_batch_size": ("train_batch_size",),
        "train_micro_batch_size_per_gpu": (
            "train_micro_batch_size_per_gpu",
            "per_device_train_batch_size",
            "micro_batch_size",
            "batch_size",
        ),
        "gradient_accumulation_steps": ("gradient_accumulation_steps",),
        "gradient_clipping": ("clip_grad", "max_grad_norm", "gradient_clipping"),
        "fp16.enabled": ("fp16",),
        "bf16.enabled": ("bf16",),
        "bfloat16.enabled": ("bf16",),
        "seed": ("seed",),
    }
    if path in by_arg:
        value = auto.arg(*by_arg[path])
        if value is not None:
            return value
        return leaf.default
    if h is not None and name == "reduce_bucket_size":
        return h * h
    if h is not None and name == "stage3_prefetch_bucket_size":
        return int(0.9 * h * h)
    if h is not None and name == "stage3_param_persistence_threshold":
        return 10 * h
    return leaf.default


def _auto_optimizer_param(name: str, default: Any, auto: AutoValues) -> Any:
    if name == "lr":
        return auto.arg("lr", "learning_rate") or default
    if name == "weight_decay":
        value = auto.arg("weight_decay")
        return default if value is None else value
    if name == "betas":
        b1, b2 = auto.arg("adam_beta1"), auto.arg("adam_beta2")
        return default if b1 is None or b2 is None else (b1, b2)
    if name == "eps":
        return auto.arg("adam_eps", "adam_epsilon") or default
    if name == "momentum":
        value = auto.arg("momentum", "sgd_momentum")
        return default if value is None else value
    return default


def _auto_scheduler_param(path: str, name: str, default: Any, lr: float, auto: AutoValues) -> Any:
    if name in ("warmup_max_lr", "cycle_max_lr", "lr_range_test_min_lr"):
        return lr
    if name in ("warmup_min_lr",):
        return 0.0
    if name == "warmup_num_steps":
        value = auto.arg("warmup_num_steps", "warmup_steps", "lr_warmup_iters")
    elif name == "total_num_steps":
        value = auto.arg("total_num_steps", "train_iters", "max_steps")
    else:
        value = None
    if value is not None:
        return value
    if default is REQUIRED or name in ("warmup_num_steps",):
        hint = {
            "warmup_num_steps": "args.warmup_num_steps (or warmup_steps)",
            "total_num_steps": "args.total_num_steps (or train_iters, max_steps)",
        }.get(name, "a value")
        raise ConfigError(
            f"{path}: cannot resolve 'auto'",
            fix=f"write a number, or give {hint} to initialize(args=...)",
        )
    return default


# --------------------------------------------------------------------------------------------
# Loading


@dataclass
class DeepSpeedKeys:
    """A DeepSpeed config sorted onto the schema (see :func:`deepspeed_keys`)."""

    nested: dict[str, dict[str, Any]] = field(default_factory=dict)
    """section -> field -> value, as :meth:`Config.from_dict` takes it"""
    origin: dict[tuple[str, str], str] = field(default_factory=dict)
    """(section, field) -> the DeepSpeed key path (and file:line) it came from"""
    notes: list[str] = field(default_factory=list)
    """warnings: unknown keys, ignored keys"""
    resolved: dict[str, Any] = field(default_factory=dict)
    """the DeepSpeed dict with "auto" replaced and the batch sizes completed"""
    has_optimizer: bool = False
    has_scheduler: bool = False


def read_deepspeed_config(
    source: str | os.PathLike | Mapping[str, Any],
) -> tuple[dict[str, Any], Callable[[tuple[str, ...]], str | None]]:
    """A DeepSpeed config as a dict: a JSON file's path, a JSON string, or a mapping.

    Returns it with ``locate(path) -> "file:line"`` (None for a mapping).
    """
    if isinstance(source, Mapping):
        return copy.deepcopy(dict(source)), lambda path: None
    text = os.fspath(source)
    if isinstance(source, str) and text.lstrip().startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"the DeepSpeed config is not valid JSON: {e}") from None
        return data, lambda path: None
    data, locate = read_config_file(text)
    return data, locate


def deepspeed_keys(
    source: str | os.PathLike | Mapping[str, Any],
    *,
    world_size: int = 1,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    auto: AutoValues | None = None,
    require_batch: bool = True,
) -> DeepSpeedKeys:
    """Validate a DeepSpeed config and sort it onto schema fields.

    ``require_batch``: a config without any batch size is an error (DeepSpeed's rule); False
    where flags may give them (``zerotron pretrain``).

    Raises :class:`ConfigError` naming the key path of a bad value (and ``file:line`` for a
    file), :class:`UnsupportedError` for a feature zerotron does not implement.
    """
    data, locate = read_deepspeed_config(source)
    if not isinstance(data, Mapping):
        raise ConfigError("a DeepSpeed config must be a JSON object", where=_label(source))
    auto = auto or AutoValues()
    out = DeepSpeedKeys(resolved=copy.deepcopy(dict(data)))
    walker = _Walker(out, locate, auto)
    for key, value in data.items():
        if key in ("optimizer", "scheduler"):
            continue
        walker.visit(SPEC, key, value, ())
    walker.optimizer(data.get("optimizer"))
    walker.scheduler(data.get("scheduler"))
    if not require_batch and not walker.batch and not walker.batch_auto:
        return out
    _resolve_batch(
        out,
        walker.batch,
        walker.batch_auto,
        world_size,
        tensor_model_parallel_size,
        pipeline_model_parallel_size,
    )
    return out


def load_deepspeed_config(
    source: str | os.PathLike | Mapping[str, Any],
    *,
    world_size: int = 1,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    auto: AutoValues | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> tuple[Config, dict[str, Any]]:
    """A validated Config from a DeepSpeed config; returns ``(config, resolved_dict)``.

    ``overrides`` are flat schema fields that win over the file (flags). DeepSpeed's defaults
    apply where it differs from Megatron's (gradient_clipping 0, steps_per_print 10, initial
    loss scale 2**16).
    """
    keys = deepspeed_keys(
        source,
        world_size=world_size,
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        auto=auto,
    )
    nested = apply_deepspeed_defaults(keys.nested)
    for name, value in (overrides or {}).items():
        nested.setdefault(FIELD_SECTION[name], {})[name] = value
    nested.setdefault("parallel", {}).update(
        world_size=world_size,
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
    )
    cfg = Config.from_dict(nested, origin=keys.origin)
    cfg._warnings.extend(keys.notes)
    return cfg, keys.resolved


DEEPSPEED_DEFAULTS: dict[str, dict[str, Any]] = {
    "optimizer": {"clip_grad": 0.0},
    "training": {"log_interval": 10},
    "precision": {"initial_loss_scale": 2.0**16},
    "zero": {
        "reduce_bucket_size": 500_000_000,
        "sub_group_size": 1_000_000_000,
        "stage3_prefetch_bucket_size": 50_000_000,
    },
}
"""Schema fields whose default DeepSpeed sets differently from Megatron."""


def apply_deepspeed_defaults(nested: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """``nested`` with DeepSpeed's defaults filled in where it leaves them out."""
    out = {section: dict(values) for section, values in nested.items()}
    for section, values in DEEPSPEED_DEFAULTS.items():
        for name, value in values.items():
            out.setdefault(section, {}).setdefault(name, value)
    return out


def _label(source: Any) -> str | None:
    return None if isinstance(source, Mapping) else os.fspath(source)


class _Walker:
    """Walks a DeepSpeed dict against :data:`SPEC`, filling a :class:`DeepSpeedKeys`."""

    def __init__(self, out: DeepSpeedKeys, locate: Callable, auto: AutoValues):
        self.out = out
        self.locate = locate
        self.auto = auto
        self.batch: dict[str, int] = {}
        self.batch_auto = False
        self.lr: float | None = None

    def where(self, path: tuple[str, ...]) -> str | None:
        return self.locate(path)

    def fail(self, e: ConfigError, path: tuple[str, ...]) -> ConfigError:
        where = self.where(path)
        if where and not e.where:
            e.where = where
            e.args = (e.format(),)
        return e

    def set(self, name: str, value: Any, path: tuple[str, ...]) -> None:
        section = FIELD_SECTION[name]
        self.out.nested.setdefault(section, {})[name] = value
        dotted = ".".join(path)
        where = self.where(path)
        self.out.origin[(section, name)] = f"{where} ({dotted})" if where else dotted

    def set_resolved(self, path: tuple[str, ...], value: Any) -> None:
        node = self.out.resolved
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = list(value) if isinstance(value, tuple) else value

    def unknown(self, path: tuple[str, ...], choices: Mapping[str, Any]) -> None:
        close = difflib.get_close_matches(path[-1], list(choices), n=1, cutoff=0.6)
        hint = f" (did you mean {'.'.join((*path[:-1], close[0]))!r}?)" if close else ""
        where = self.where(path)
        self.out.notes.append(
            f"{where + ': ' if where else ''}unknown DeepSpeed key {'.'.join(path)!r} ignored{hint}"
        )

    def visit(self, spec: Mapping[str, Any], key: str, value: Any, parent: tuple) -> None:
        path = (*parent, key)
        dotted = ".".join(path)
        if key not in spec:
            self.unknown(path, spec)
            return
        node = spec[key]
        if isinstance(node, Refused):
            if not node.harmless(value):
                raise UnsupportedError(
                    f"{dotted}: {node.why}",
                    where=self.where(path),
                    fix=f"remove {dotted!r} from the DeepSpeed config",
                )
            return
        if isinstance(node, Ignored):
            if node.why:
                self.out.notes.append(f"{dotted} has no effect in zerotron ({node.why}); ignored")
            return
        if isinstance(node, dict):
            if value is None:
                return
            if not isinstance(value, Mapping):
                raise self.fail(
                    ConfigError(
                        f"{dotted}: expected an object of keys, got {value!r}",
                        fix="correct the value",
                    ),
                    path,
                )
            for sub, sub_value in value.items():
                self.visit(node, sub, sub_value, path)
            return
        self.leaf(node, path, value)

    def leaf(self, leaf: Leaf, path: tuple[str, ...], value: Any) -> None:
        dotted = ".".join(path)
        is_batch = leaf.field in BATCH_FIELDS
        if value == AUTO:
            value = _auto_leaf(dotted, leaf, self.auto)
            if value is None and is_batch:
                self.batch_auto = True
        if value is None:
            return  # null (or an "auto" with nothing to resolve it): the default
        try:
            parsed = leaf.parse(dotted, value)
        except ConfigError as e:
            raise self.fail(e, path) from None
        self.set_resolved(path, parsed)
        if is_batch:
            self.batch[leaf.field] = parsed
            return
        self.set(leaf.field, leaf.to_field(parsed) if leaf.to_field else parsed, path)

    # ---- optimizer and scheduler

    def optimizer(self, block: Any) -> None:
        if block is None:
            return
        path = ("optimizer",)
        if not isinstance(block, Mapping):
            raise self.fail(ConfigError(f"optimizer: expected an object, got {block!r}"), path)
        for key in block:
            if key not in ("type", "params"):
                self.unknown((*path, key), {"type": 0, "params": 0})
        kind = block.get("type")
        if not isinstance(kind, str):
            raise self.fail(
                ConfigError(
                    f"optimizer.type: {kind!r} is not an optimizer name",
                    fix="use Adam, AdamW, Lamb or SGD",
                ),
                (*path, "type"),
            )
        low = kind.lower()
        if low in UNSUPPORTED_OPTIMIZERS:
            raise UnsupportedError(
                f"optimizer.type: {UNSUPPORTED_OPTIMIZERS[low]} is not supported by zerotron",
                where=self.where((*path, "type")),
                fix="use Adam, AdamW, Lamb or SGD",
            )
        if low not in OPTIMIZERS:
            close = difflib.get_close_matches(low, list(OPTIMIZERS), n=1, cutoff=0.5)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(
                f"optimizer.type: unknown optimizer {kind!r}",
                where=self.where((*path, "type")),
                fix=f"{hint}use Adam, AdamW, Lamb or SGD",
            )
        self.out.has_optimizer = True
        self.set("optimizer", OPTIMIZERS[low], (*path, "type"))
        spec = OPTIMIZER_PARAMS[OPTIMIZERS[low]]
        params = block.get("params") or {}
        if not isinstance(params, Mapping):
            raise self.fail(
                ConfigError(f"optimizer.params: expected an object, got {params!r}"),
                (*path, "params"),
            )
        self.out.resolved.setdefault("optimizer", {}).setdefault("params", {})
        for name, value in params.items():
            ppath = (*path, "params", name)
            node = spec.get(name)
            if node is None:
                self.unknown(ppath, spec)
                continue
            if not isinstance(node, Leaf):
                self.visit(spec, name, value, (*path, "params"))
                continue
            if value == AUTO:
                value = _auto_optimizer_param(name, node.default, self.auto)
            try:
                parsed = node.parse(".".join(ppath), value)
            except ConfigError as e:
                raise self.fail(e, ppath) from None
            self.set_resolved(ppath, parsed)
            if name == "betas":
                self.set("adam_beta1", parsed[0], ppath)
                self.set("adam_beta2", parsed[1], ppath)
            else:
                self.set(node.field, parsed, ppath)
        # DeepSpeed's defaults for what params leave out (torch's differ: AdamW decays 0.01).
        given = self.out.nested.get("optimizer", {})
        for name, node in spec.items():
            if isinstance(node, Leaf) and name != "betas" and node.field not in given:
                self.set(node.field, node.default, (*path, "params", name))
        self.lr = self.out.nested["optimizer"]["lr"]

    def scheduler(self, block: Any) -> None:
        if block is None:
            return
        path = ("scheduler",)
        if not isinstance(block, Mapping):
            raise self.fail(ConfigError(f"scheduler: expected an object, got {block!r}"), path)
        for key in block:
            if key not in ("type", "params"):
                self.unknown((*path, key), {"type": 0, "params": 0})
        kind = block.get("type")
        if kind in UNSUPPORTED_SCHEDULERS:
            raise UnsupportedError(
                f"scheduler.type: {kind} is not supported by zerotron",
                where=self.where((*path, "type")),
                fix=f"use one of {', '.join(SCHEDULER_PARAMS)}",
            )
        if kind not in SCHEDULER_PARAMS:
            names = list(SCHEDULER_PARAMS)
            close = difflib.get_close_matches(str(kind), names, n=1, cutoff=0.5)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(
                f"scheduler.type: {kind!r} is not one of {', '.join(names)}",
                where=self.where((*path, "type")),
                fix=f"{hint}use one of {', '.join(names)}",
            )
        self.out.has_scheduler = True
        spec = SCHEDULER_PARAMS[kind]
        params = block.get("params") or {}
        if not isinstance(params, Mapping):
            raise self.fail(
                ConfigError(f"scheduler.params: expected an object, got {params!r}"),
                (*path, "params"),
            )
        lr = self.lr if self.lr is not None else self.auto.optimizer_lr
        if lr is None:
            lr = self.auto.arg("lr", "learning_rate") or 1e-3
        resolved: dict[str, Any] = {}
        for name, value in params.items():
            ppath = (*path, "params", name)
            if name == "last_batch_iteration":
                continue
            if name not in spec:
                self.unknown(ppath, spec)
                continue
            parse, default = spec[name]
            if value == AUTO:
                value = _auto_scheduler_param(".".join(ppath), name, default, lr, self.auto)
            try:
                resolved[name] = parse(".".join(ppath), value)
            except ConfigError as e:
                raise self.fail(e, ppath) from None
        for name, (_, default) in spec.items():
            if name not in resolved:
                if default is REQUIRED:
                    raise ConfigError(
                        f"scheduler.params.{name} is required by {kind}",
                        where=self.where((*path, "params")),
                        fix=f"add {name!r} to scheduler.params",
                    )
                resolved[name] = default
        if kind == "WarmupLR" and "warmup_max_lr" not in params:
            resolved["warmup_max_lr"] = lr  # DeepSpeed: the optimizer's lr when not given
        self.out.resolved["scheduler"] = {"type": kind, "params": dict(resolved)}
        self.set("lr_scheduler_type", kind, (*path, "type"))
        self.set("lr_scheduler_params", resolved, (*path, "params"))


def _resolve_batch(
    out: DeepSpeedKeys, batch: dict[str, int], auto: bool, world: int, tp: int, pp: int
) -> None:
    """train_batch_size = micro × accumulation × DP, DP = world / (tp·pp); any two give the
    third, as DeepSpeed's ``_configure_train_batch_size`` does."""
    if world % (tp * pp):
        raise ConfigError(
            f"world size {world} is not divisible by tensor parallel {tp} × pipeline parallel "
            f"{pp} = {tp * pp}",
            fix=f"launch a multiple of {tp * pp} processes",
        )
    dp = world // (tp * pp)
    dp_text = f"data-parallel size {dp} (world {world} / (tp {tp} × pp {pp}))"
    tbs = batch.get("global_batch_size")
    mbs = batch.get("micro_batch_size")
    gas = batch.get("num_micro_batches")
    if tbs is None and mbs is None:
        if not auto:
            raise ConfigError(
                "neither train_batch_size nor train_micro_batch_size_per_gpu is given",
                fix="set train_micro_batch_size_per_gpu (and gradient_accumulation_steps), or "
                "train_batch_size",
            )
        mbs = 1  # everything "auto" and nothing to resolve it from
    if tbs is not None and mbs is not None and gas is not None:
        if tbs != mbs * gas * dp:
            raise ConfigError(
                f"train_batch_size {tbs} != train_micro_batch_size_per_gpu {mbs} × "
                f"gradient_accumulation_steps {gas} × {dp_text} = {mbs * gas * dp}",
                where="train_batch_size",
                fix="give only two of the three; the third is derived",
            )
    elif tbs is not None and mbs is not None:
        if tbs % (mbs * dp):
            raise ConfigError(
                f"train_batch_size {tbs} is not divisible by train_micro_batch_size_per_gpu "
                f"{mbs} × {dp_text} = {mbs * dp}",
                where="train_batch_size",
                fix=f"use a multiple of {mbs * dp}",
            )
        gas = tbs // (mbs * dp)
    elif tbs is not None:
        gas = gas or 1
        if tbs % (gas * dp):
            raise ConfigError(
                f"train_batch_size {tbs} is not divisible by gradient_accumulation_steps {gas} "
                f"× {dp_text} = {gas * dp}",
                where="train_batch_size",
                fix=f"use a multiple of {gas * dp}",
            )
        mbs = tbs // (gas * dp)
    else:
        gas = gas or 1
        tbs = mbs * gas * dp
    # Only what the file gave (flags may override one; the schema derives the rest the same way).
    training = out.nested.setdefault("training", {})
    given = {**batch} if batch else {"micro_batch_size": mbs}
    for name, ds_name in BATCH_FIELDS.items():
        if name in given:
            training[name] = given[name]
            out.origin[("training", name)] = ds_name
    out.resolved.update(
        train_batch_size=tbs, train_micro_batch_size_per_gpu=mbs, gradient_accumulation_steps=gas
    )


def format_resolved(resolved: Mapping[str, Any]) -> str:
    """The resolved DeepSpeed config as zerotron prints it once at start (rank 0)."""
    return "zerotron DeepSpeed config (auto values resolved):\n" + json.dumps(
        resolved, indent=2, sort_keys=True, default=str
    )
