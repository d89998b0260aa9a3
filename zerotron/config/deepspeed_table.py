"""DeepSpeed's JSON keys as a table onto the one schema: key path -> schema field, with the
converter that checks the value in DeepSpeed's words and DeepSpeed's default.

A dict in :data:`SPEC` is a section of DeepSpeed's JSON; a :class:`Leaf` sets a schema field;
:class:`Ignored` keys are accepted without effect; :class:`Refused` keys name a DeepSpeed
feature zerotron does not implement. ``optimizer`` and ``scheduler`` have a table per type
(:data:`OPTIMIZER_PARAMS`, :data:`SCHEDULER_PARAMS`). The walker that reads a config against
these tables is :mod:`zerotron.config.deepspeed`; docs/deepspeed.md lists the keys.
:func:`read_offload` reads one offload section against its table for offload options built
without a config, so the offload values have one set of rules wherever they come from.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from zerotron.config.convert import (
    BETAS,
    BOOL,
    CHOICE,
    FLOAT,
    INT,
    NON_NEGATIVE,
    OPT_STR,
    OPTIONAL,
    POSITIVE,
    STR,
    Parse,
    bad_value,
    from_field,
    parse_at,
)
from zerotron.config.sections import AutotuningConfig, FlopsProfilerConfig, ZeroConfig
from zerotron.errors import ConfigError, UnsupportedError

AUTO = "auto"
NEVER = 2**62  # steps_per_print "inf" (accelerate writes it): an interval no run reaches


def STEPS_PER_PRINT(path: str, value: Any) -> int:
    """A positive step count, or infinity for never (as DeepSpeed's ``step % inf`` never is 0)."""
    if isinstance(value, float) and value == float("inf"):
        return NEVER
    return POSITIVE(INT)(path, value)


BATCH_FIELDS = {
    "global_batch_size": "train_batch_size",
    "micro_batch_size": "train_micro_batch_size_per_gpu",
    "num_micro_batches": "gradient_accumulation_steps",
}
"""The batch fields and DeepSpeed's keys for them (resolved together by the loader)."""

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
    """``zero_optimization.offload_<kind>``: each key is the zero section's field
    ``offload_<kind>_<key>``, checked by that field's definition (the one place offload values
    are defined)."""

    def leaf(key: str) -> Leaf:
        name = f"offload_{kind}_{key}"
        return Leaf(name, from_field(ZeroConfig, name), ZeroConfig.model_fields[name].default)

    node: dict[str, Any] = {
        key: leaf(key) for key in ("device", "nvme_path", "pin_memory", "buffer_count")
    }
    if kind == "param":
        node["buffer_size"] = leaf("buffer_size")
        node["max_in_cpu"] = leaf("max_in_cpu")
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
        raise bad_value(path, value, "one of 0, 1, 2, 3")
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


def read_offload(kind: str, section: Mapping[str, Any], where: str) -> dict[str, Any]:
    """One offload section (``zero_optimization.offload_<kind>``, at key path ``where``) read
    against its table above: the values of its keys that set a field, parsed; ignored keys
    dropped; null left out (the default).

    For offload options built outside a config (:class:`~zerotron.zero.options.OffloadOptions`:
    ``zero.Init``'s dict, direct Python use), so they obey the rules a DeepSpeed JSON does.
    With no config to collect warnings into, an unknown key raises; each error names
    ``<where>.<key>`` (``where`` itself for an unknown key) in ``where``.
    """
    node = _ZERO[f"offload_{kind}"]
    unknown = sorted(set(section) - set(node))
    if unknown:
        ignored = sorted(k for k, v in node.items() if isinstance(v, Ignored))
        fix = f"use {sorted(k for k, v in node.items() if isinstance(v, Leaf))}"
        raise ConfigError(
            f"unknown key(s) {unknown}",
            where=where,
            fix=fix + (f" (DeepSpeed's {ignored} are ignored)" if ignored else ""),
        )
    out: dict[str, Any] = {}
    for key, value in section.items():
        spec, path = node[key], f"{where}.{key}"
        if isinstance(spec, Refused) and not spec.harmless(value):
            raise UnsupportedError(spec.why, where=path, fix=f"remove {key!r}")
        if isinstance(spec, Leaf) and value is not None:
            out[key] = parse_at(spec.parse, path, value)
    return out


def _arg_mappings(path: str, value: Any) -> dict[str, str] | None:
    """``autotuning.arg_mappings``: DeepSpeed config key -> the script's flag (``--x``)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise bad_value(path, value, "an object of DeepSpeed key -> script flag")
    out: dict[str, str] = {}
    for key, flag_name in value.items():
        # DeepSpeed strips both (its tutorial's "gradient_accumulation_steps " has a space).
        if not isinstance(flag_name, str) or not flag_name.strip().startswith("-"):
            raise bad_value(f"{path}.{key}", flag_name, "a flag of the script, e.g. '--batch-size'")
        out[str(key).strip()] = flag_name.strip()
    return out


def _autotuning() -> dict[str, Any]:
    """DeepSpeed's ``autotuning`` block: every key a field ``autotuning_<key>`` of
    :class:`~zerotron.config.sections.AutotuningConfig` (checked by its definition, with
    DeepSpeed's default); ``model_info`` is a section of its own keys."""

    def leaf(key: str, parse: Parse | None = None) -> Leaf:
        name = f"autotuning_{key}"
        default = AutotuningConfig.model_fields[name].default
        return Leaf(name, parse or from_field(AutotuningConfig, name), default)

    keys = [k.removeprefix("autotuning_") for k in AutotuningConfig.model_fields]
    node: dict[str, Any] = {
        k: leaf(k) for k in keys if not k.startswith("model_info_") and k != "arg_mappings"
    }
    node["model_info_path"] = leaf("model_info_path")
    node["arg_mappings"] = leaf("arg_mappings", _arg_mappings)
    node["model_info"] = {
        k.removeprefix("model_info_"): leaf(k)
        for k in keys
        if k.startswith("model_info_") and k != "model_info_path"
    }
    return node


def _comm_dtype(path: str, value: Any) -> str:
    names = {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16", "bfp16": "bf16", "float32": "fp32"}
    if isinstance(value, str) and value.lower() in names:
        return names[value.lower()]
    raise bad_value(path, value, "one of fp32, fp16, bf16")


_MONITOR_JOB = "DeepSpeedJobName"

SPEC: dict[str, Any] = {
    # batch (resolved together, see _resolve_batch)
    "train_batch_size": Leaf("global_batch_size", POSITIVE(INT)),
    "train_micro_batch_size_per_gpu": Leaf("micro_batch_size", POSITIVE(INT)),
    "gradient_accumulation_steps": Leaf("num_micro_batches", POSITIVE(INT)),
    "steps_per_print": Leaf("log_interval", STEPS_PER_PRINT, 10),
    "seed": Leaf("seed", NON_NEGATIVE(INT), 1234),
    # DeepSpeed's default has been 1.0 since 0.19.3 (0, off, before), Megatron's too.
    "gradient_clipping": Leaf("clip_grad", NON_NEGATIVE(FLOAT), 1.0),
    "prescale_gradients": Leaf("prescale_gradients", BOOL, False),
    "gradient_predivide_factor": Leaf("gradient_predivide_factor", POSITIVE(FLOAT), 1.0),
    "communication_data_type": Leaf(
        "communication_data_type",
        OPTIONAL(_comm_dtype),
        None,
    ),
    "zero_force_ds_cpu_optimizer": Leaf("zero_force_ds_cpu_optimizer", BOOL, True),
    "wall_clock_breakdown": Leaf("wall_clock_breakdown", BOOL, False),
    # zerotron's own: the metrics file of `zerotron report` (DeepSpeed has no such key)
    "metrics_dir": Leaf("metrics_dir", OPT_STR, None),
    # zerotron's own keys (DeepSpeed has no timeline recorder): --profile-steps, --profile-dir
    "profile_steps": Leaf("profile_steps", OPT_STR, None),
    "profile_dir": Leaf("profile_dir", OPT_STR, None),
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
    "autotuning": _autotuning(),  # zerotron tune (zerotron/tuning/tune.py)
    "flops_profiler": {  # zerotron/engine/flops_profiler.py
        name.removeprefix("flops_profiler_"): Leaf(
            name, from_field(FlopsProfilerConfig, name), info.default
        )
        for name, info in FlopsProfilerConfig.model_fields.items()
    },
    "activation_checkpointing": {
        "partition_activations": Leaf("partition_activations", BOOL, False),
        "cpu_checkpointing": Leaf("cpu_checkpointing", BOOL, False),
        "contiguous_memory_optimization": Leaf("contiguous_memory_optimization", BOOL, False),
        "number_checkpoints": Leaf("number_checkpoints", OPTIONAL(POSITIVE(INT)), None),
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
        "load_universal": Leaf("load_universal", BOOL, False),
        "parallel_write": Ignored("checkpoint files are written by one rank each"),
        # DeepSpeed's background ("decoupled") writer; zerotron's own writer does the same job.
        "writer": {
            "decoupled": Leaf("async_save", BOOL, False),
            **{
                key: Ignored("zerotron's checkpoint writer has no such tuning")
                for key in (
                    "type",
                    "io_buffer_size",
                    "io_buffer_double",
                    "show_statistics",
                    "data_parallel",
                    "io_multiplier",
                )
            },
        },
        # zerotron's own key (DeepSpeed keeps every checkpoint): --save-keep-last
        "keep_last": Leaf("save_keep_last", OPTIONAL(POSITIVE(INT)), None),
    },
    # accepted, no effect
    "zero_allow_untested_optimizer": Ignored(""),
    "memory_breakdown": Ignored(
        "zerotron pretrain --memory-breakdown-step N measures one step's memory per term"
    ),
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
    "quantize_training": Refused("quantization-aware training is not implemented"),
    "eigenvalue": Refused("eigenvalue computation is not implemented"),
    "progressive_layer_drop": Refused("progressive layer dropping is not implemented"),
    "hybrid_engine": Refused(
        "the hybrid (RLHF) engine, DeepSpeed-Inference kernels for generation, is not "
        "implemented; without it the actor generates on its training engine's weights, "
        "gathered under ZeRO-3 (DeepSpeed-Chat: drop --enable_hybrid_engine)"
    ),
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


# Optimizers. DeepSpeed lower-cases the type; "Adam" is AdamW unless adam_w_mode is false.
OPTIMIZERS = {
    "adam": "adam",
    "adamw": "adamw",
    "sgd": "sgd",
    "lamb": "lamb",
    "lion": "lion",
    "adagrad": "adagrad",
}
UNSUPPORTED_OPTIMIZERS = {
    "onebitadam": "OneBitAdam",
    "zerooneadam": "ZeroOneAdam",
    "onebitlamb": "OneBitLamb",
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
    # DeepSpeed's FusedLion / DeepSpeedCPULion defaults; betas are Adam's fields.
    "lion": {
        "lr": Leaf("lr", NON_NEGATIVE(FLOAT), 1e-3),
        "betas": Leaf("betas", BETAS, (0.9, 0.999)),
        "weight_decay": Leaf("weight_decay", NON_NEGATIVE(FLOAT), 0.0),
    },
    # DeepSpeedCPUAdagrad's defaults (torch.optim.Adagrad's without offload: the same values);
    # torch's further switches change the math, so they are refused unless at their no-op value.
    "adagrad": {
        "lr": Leaf("lr", NON_NEGATIVE(FLOAT), 1e-2),
        "eps": Leaf("adam_eps", POSITIVE(FLOAT), 1e-10),
        "weight_decay": Leaf("weight_decay", NON_NEGATIVE(FLOAT), 0.0),
        "lr_decay": Refused("Adagrad's lr_decay is not implemented", lambda v: v in (None, 0)),
        "initial_accumulator_value": Refused(
            "Adagrad's initial_accumulator_value is not implemented", lambda v: v in (None, 0)
        ),
        "amsgrad": Refused("AMSGrad is not implemented", lambda v: v in (None, False)),
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
        "cycle_second_step_size": (OPTIONAL(POSITIVE(INT)), None),
        "cycle_first_stair_count": (NON_NEGATIVE(INT), 0),
        "cycle_second_stair_count": (
            OPTIONAL(NON_NEGATIVE(INT)),
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


DEEPSPEED_DEFAULTS: dict[str, dict[str, Any]] = {
    "training": {"log_interval": 10},
    "precision": {"initial_loss_scale": 2.0**16},
    "zero": {
        "reduce_bucket_size": 500_000_000,
        "sub_group_size": 1_000_000_000,
        "stage3_prefetch_bucket_size": 50_000_000,
        "stage3_max_reuse_distance": 1_000_000_000,
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
