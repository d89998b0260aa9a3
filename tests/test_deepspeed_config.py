"""DeepSpeed JSON -> the schema: every documented key, batch arithmetic, "auto", unknown keys,
unsupported features, key paths in errors, and `zerotron pretrain --deepspeed_config`."""

from __future__ import annotations

import argparse
import json
import math
import shlex

import pytest

from zerotron.config import AutoValues, load_deepspeed_config, parse_megatron_args
from zerotron.config.deepspeed import deepspeed_keys
from zerotron.errors import ConfigError, UnsupportedError

FULL = {
    "train_batch_size": 32,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "steps_per_print": 7,
    "seed": 42,
    "gradient_clipping": 0.5,
    "prescale_gradients": True,
    "gradient_predivide_factor": 2.0,
    "communication_data_type": "bf16",
    "zero_force_ds_cpu_optimizer": False,
    "wall_clock_breakdown": True,
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.05},
    },
    "scheduler": {
        "type": "WarmupCosineLR",
        "params": {"total_num_steps": 100, "warmup_num_steps": 10, "cos_min_ratio": 0.1},
    },
    "fp16": {
        "enabled": True,
        "auto_cast": True,
        "loss_scale": 0,
        "initial_scale_power": 12,
        "loss_scale_window": 500,
        "hysteresis": 3,
        "consecutive_hysteresis": True,
        "min_loss_scale": 0.5,
    },
    "bf16": {"enabled": False},
    "zero_optimization": {
        "stage": 3,
        "allgather_partitions": False,
        "allgather_bucket_size": 2e8,
        "overlap_comm": False,
        "reduce_scatter": False,
        "reduce_bucket_size": "3e8",
        "contiguous_gradients": False,
        "round_robin_gradients": True,
        "offload_optimizer": {
            "device": "nvme",
            "nvme_path": "/nvme/opt",
            "pin_memory": True,
            "buffer_count": 6,
        },
        "offload_param": {"device": "cpu", "pin_memory": True, "buffer_count": 3},
        "sub_group_size": 1e8,
        "stage3_prefetch_bucket_size": 1e7,
        "stage3_param_persistence_threshold": 1e4,
        "stage3_max_live_parameters": 2e9,
        "stage3_max_reuse_distance": 3e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "activation_checkpointing": {
        "partition_activations": True,
        "cpu_checkpointing": True,
        "contiguous_memory_optimization": True,
        "number_checkpoints": 4,
        "synchronize_checkpoint_boundary": True,
        "profile": True,
    },
    "tensorboard": {"enabled": True, "output_path": "tb/", "job_name": "run1"},
    "wandb": {"enabled": True, "group": "g", "team": "t", "project": "p"},
    "csv_monitor": {"enabled": True, "output_path": "csv/", "job_name": "run2"},
    "checkpoint": {"use_node_local_storage": True, "tag_validation": "fail"},
}

EXPECTED = {
    "global_batch_size": 32,
    "micro_batch_size": 4,
    "num_micro_batches": 2,
    "log_interval": 7,
    "seed": 42,
    "clip_grad": 0.5,
    "prescale_gradients": True,
    "gradient_predivide_factor": 2.0,
    "communication_data_type": "bf16",
    "zero_force_ds_cpu_optimizer": False,
    "wall_clock_breakdown": True,
    "optimizer": "adamw",
    "lr": 3e-4,
    "adam_beta1": 0.8,
    "adam_beta2": 0.95,
    "adam_eps": 1e-6,
    "weight_decay": 0.05,
    "lr_scheduler_type": "WarmupCosineLR",
    "lr_scheduler_params": {
        "total_num_steps": 100,
        "warmup_num_steps": 10,
        "cos_min_ratio": 0.1,
        "warmup_min_ratio": 0.0,
        "warmup_type": "log",
    },
    "fp16": True,
    "fp16_auto_cast": True,
    "loss_scale": None,
    "initial_loss_scale": 4096.0,
    "loss_scale_window": 500,
    "hysteresis": 3,
    "consecutive_hysteresis": True,
    "min_loss_scale": 0.5,
    "bf16": False,
    "zero_stage": 3,
    "allgather_partitions": False,
    "allgather_bucket_size": 200_000_000,
    "overlap_comm": False,
    "reduce_scatter": False,
    "reduce_bucket_size": 300_000_000,
    "contiguous_gradients": False,
    "round_robin_gradients": True,
    "offload_optimizer_device": "nvme",
    "offload_optimizer_nvme_path": "/nvme/opt",
    "offload_optimizer_pin_memory": True,
    "offload_optimizer_buffer_count": 6,
    "offload_param_device": "cpu",
    "offload_param_pin_memory": True,
    "offload_param_buffer_count": 3,
    "sub_group_size": 100_000_000,
    "stage3_prefetch_bucket_size": 10_000_000,
    "stage3_param_persistence_threshold": 10_000,
    "stage3_max_live_parameters": 2_000_000_000,
    "stage3_max_reuse_distance": 3_000_000_000,
    "stage3_gather_16bit_weights_on_model_save": True,
    "partition_activations": True,
    "cpu_checkpointing": True,
    "contiguous_memory_optimization": True,
    "number_checkpoints": 4,
    "synchronize_checkpoint_boundary": True,
    "checkpointing_profile": True,
    "tensorboard_enabled": True,
    "tensorboard_output_path": "tb/",
    "tensorboard_job_name": "run1",
    "wandb_enabled": True,
    "wandb_group": "g",
    "wandb_team": "t",
    "wandb_project": "p",
    "csv_monitor_enabled": True,
    "csv_monitor_output_path": "csv/",
    "csv_monitor_job_name": "run2",
    "use_node_local_storage": True,
    "checkpoint_tag_validation": "Fail",
    "data_parallel_size": 4,
}


def load(ds: dict, world_size: int = 1, **kw):
    cfg, resolved = load_deepspeed_config(ds, world_size=world_size, **kw)
    return cfg, resolved


def test_every_key_maps_onto_its_field():
    cfg, _ = load(FULL, world_size=4)
    flat = cfg.flat()
    assert {name: flat[name] for name in EXPECTED} == EXPECTED
    assert cfg.warnings == []


def test_deepspeed_defaults():
    cfg, _ = load({"train_micro_batch_size_per_gpu": 2})
    flat = cfg.flat()
    defaults = {
        "num_micro_batches": 1,
        "global_batch_size": 2,
        "log_interval": 10,
        "clip_grad": 1.0,  # DeepSpeed's default since 0.19.3
        "initial_loss_scale": 2.0**16,
        "loss_scale_window": 1000,
        "hysteresis": 2,
        "min_loss_scale": 1.0,
        "loss_scale": None,
        "consecutive_hysteresis": False,
        "zero_stage": 0,
        "reduce_bucket_size": 500_000_000,
        "allgather_bucket_size": 500_000_000,
        "overlap_comm": False,
        "reduce_scatter": True,
        "contiguous_gradients": True,
        "sub_group_size": 1_000_000_000,
        "stage3_prefetch_bucket_size": 50_000_000,
        "stage3_param_persistence_threshold": 100_000,
        "stage3_max_live_parameters": 1_000_000_000,
        "stage3_max_reuse_distance": 1_000_000_000,
        "offload_optimizer_device": "none",
        "gradient_predivide_factor": 1.0,
        "prescale_gradients": False,
        "zero_force_ds_cpu_optimizer": True,
        "checkpoint_tag_validation": "Warn",
        "tensorboard_job_name": "DeepSpeedJobName",
        "wandb_project": "deepspeed",
        "lr_scheduler_type": None,
    }
    assert {name: flat[name] for name in defaults} == defaults
    # overlap_comm defaults to on for stage 3 only (DeepSpeed's rule)
    cfg, _ = load({"train_batch_size": 2, "zero_optimization": {"stage": 3}})
    assert cfg.zero.overlap_comm is True
    # optimizer params left out take DeepSpeed's defaults (Adam: weight_decay 0, AdamW mode)
    cfg, _ = load({"train_batch_size": 2, "optimizer": {"type": "Adam"}})
    o = cfg.optimizer
    assert (o.optimizer, o.lr, o.weight_decay, o.adam_w_mode) == ("adam", 1e-3, 0.0, True)
    assert (o.adam_beta1, o.adam_beta2, o.adam_eps) == (0.9, 0.999, 1e-8)
    cfg, _ = load({"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    assert (cfg.optimizer.optimizer, cfg.optimizer.sgd_momentum) == ("sgd", 0.0)
    cfg, _ = load({"train_batch_size": 2, "fp16": {"enabled": True, "loss_scale": 128}})
    assert cfg.precision.loss_scale == 128.0  # static
    cfg, _ = load({"train_batch_size": 2, "bfloat16": {"enabled": True}})
    assert cfg.precision.bf16


def test_lion_params_and_deepspeeds_defaults():
    # DeepSpeed lower-cases the type; Lion's betas are the Adam fields, its defaults DeepSpeed's.
    lion = {"lr": 3e-4, "betas": [0.95, 0.98], "weight_decay": 0.1}
    cfg, _ = load({"train_batch_size": 2, "optimizer": {"type": "LION", "params": lion}})
    o = cfg.optimizer
    assert (o.optimizer, o.lr, o.adam_beta1, o.adam_beta2, o.weight_decay) == (
        "lion", 3e-4, 0.95, 0.98, 0.1,
    )  # fmt: skip
    cfg, _ = load({"train_batch_size": 2, "optimizer": {"type": "Lion"}})
    o = cfg.optimizer
    assert (o.lr, o.adam_beta1, o.adam_beta2, o.weight_decay) == (1e-3, 0.9, 0.999, 0.0)


def test_adagrad_params_and_deepspeeds_defaults():
    adagrad = {"lr": 0.05, "eps": 1e-6, "weight_decay": 0.1}
    cfg, _ = load({"train_batch_size": 2, "optimizer": {"type": "adagrad", "params": adagrad}})
    o = cfg.optimizer
    assert (o.optimizer, o.lr, o.adam_eps, o.weight_decay) == ("adagrad", 0.05, 1e-6, 0.1)
    cfg, _ = load({"train_batch_size": 2, "optimizer": {"type": "Adagrad"}})
    o = cfg.optimizer
    assert (o.lr, o.adam_eps, o.weight_decay) == (1e-2, 1e-10, 0.0)
    # torch's switches at their no-op values pass
    noop = {"lr_decay": 0, "initial_accumulator_value": 0.0, "amsgrad": False}
    cfg, _ = load({"train_batch_size": 2, "optimizer": {"type": "Adagrad", "params": noop}})
    assert cfg.optimizer.optimizer == "adagrad"


# ---- batch sizes


def test_without_a_deepspeed_config_zero_sizes_are_zerotrons():
    """Flags and the schema leave the bucket, sub-group and prefetch sizes unset: ZeroOptimizer
    takes zerotron's (stage 3 in pieces of a few MB, the next module prefetched, every
    parameter released after use), a DeepSpeed config DeepSpeed's (test_deepspeed_defaults)."""
    from zerotron.config import ZeroConfig
    from zerotron.zero.options import default_sizes

    z = ZeroConfig()
    assert (z.reduce_bucket_size, z.sub_group_size, z.stage3_prefetch_bucket_size) == (
        None,
        None,
        None,
    )
    assert z.stage3_max_reuse_distance == 0
    assert default_sizes(3, None, None) == (4_000_000, 2_000_000)
    assert default_sizes(1, None, None) == default_sizes(2, None, None) == (500_000_000, 10**9)
    assert default_sizes(3, 7, 9) == (7, 9)


@pytest.mark.parametrize(
    "given,world,tp,pp,want",
    [
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 4, 1, 1, (32, 4, 2)),
        ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4, 1, 1, (32, 4, 2)),
        (
            {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3},
            4,
            1,
            1,
            (48, 4, 3),
        ),
        ({"train_batch_size": 16}, 4, 1, 1, (16, 4, 1)),
        ({"train_micro_batch_size_per_gpu": 4}, 8, 2, 2, (8, 4, 1)),
        ({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 3}, 8, 2, 1, (24, 3, 2)),
    ],
)
def test_any_two_batch_sizes_give_the_third(given, world, tp, pp, want):
    cfg, resolved = load(
        given, world, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
    )
    t = cfg.training
    assert (t.global_batch_size, t.micro_batch_size, t.num_micro_batches) == want
    assert cfg.parallel.data_parallel_size == world // (tp * pp)
    assert (
        resolved["train_batch_size"],
        resolved["train_micro_batch_size_per_gpu"],
        resolved["gradient_accumulation_steps"],
    ) == want


def test_inconsistent_batch_sizes_show_the_arithmetic():
    ds = {
        "train_batch_size": 30,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
    }
    with pytest.raises(ConfigError) as e:
        load(ds, 8, tensor_model_parallel_size=2)
    assert (
        "train_batch_size 30 != train_micro_batch_size_per_gpu 4 × gradient_accumulation_steps 2 × "
        "data-parallel size 4 (world 8 / (tp 2 × pp 1)) = 32" in str(e.value)
    )
    with pytest.raises(
        ConfigError, match=r"train_batch_size 30 is not divisible by .* 4 × .* = 16"
    ):
        load({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, 4)
    with pytest.raises(ConfigError, match="neither train_batch_size nor"):
        load({"gradient_accumulation_steps": 2})


# ---- auto


def test_auto_values_resolve_from_args_model_and_defaults():
    ds = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "fp16": {"enabled": "auto", "loss_scale_window": "auto"},
        "bf16": {"enabled": "auto"},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": "auto",
                "warmup_max_lr": "auto",
                "warmup_num_steps": "auto",
            },
        },
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
            "stage3_gather_16bit_weights_on_model_save": "auto",
        },
    }
    args = argparse.Namespace(
        per_device_train_batch_size=3,
        gradient_accumulation_steps=2,
        max_grad_norm=0.7,
        bf16=True,
        learning_rate=5e-4,
        adam_beta1=0.85,
        adam_beta2=0.9,
        adam_epsilon=1e-7,
        weight_decay=0.02,
        warmup_steps=11,
    )
    cfg, resolved = load(ds, 2, auto=AutoValues(args=args, hidden_size=64))
    t, o, z = cfg.training, cfg.optimizer, cfg.zero
    assert (t.micro_batch_size, t.num_micro_batches, t.global_batch_size) == (3, 2, 12)
    assert (o.clip_grad, o.lr, o.adam_beta1, o.adam_beta2, o.adam_eps, o.weight_decay) == (
        0.7,
        5e-4,
        0.85,
        0.9,
        1e-7,
        0.02,
    )
    assert cfg.precision.bf16 and not cfg.precision.fp16
    assert cfg.precision.loss_scale_window == 1000  # no source: DeepSpeed's default
    assert cfg.scheduler.lr_scheduler_params == {
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 5e-4,
        "warmup_num_steps": 11,
        "warmup_type": "log",
    }
    assert z.reduce_bucket_size == 64 * 64
    assert z.stage3_prefetch_bucket_size == int(0.9 * 64 * 64)
    assert z.stage3_param_persistence_threshold == 640
    assert z.stage3_gather_16bit_weights_on_model_save is False
    # The resolved dict has no "auto" left.
    assert "auto" not in json.dumps(resolved)
    assert resolved["optimizer"]["params"]["betas"] == [0.85, 0.9]


def test_auto_without_a_source():
    cfg, _ = load(
        {
            "train_micro_batch_size_per_gpu": "auto",
            "optimizer": {"type": "Adam", "params": {"lr": "auto"}},
        }
    )
    assert (cfg.training.micro_batch_size, cfg.optimizer.lr) == (1, 1e-3)
    # the passed optimizer's lr is what an "auto" warmup_max_lr means without an optimizer section
    cfg, _ = load(
        {
            "train_batch_size": 1,
            "scheduler": {
                "type": "WarmupLR",
                "params": {"warmup_max_lr": "auto", "warmup_num_steps": 3},
            },
        },
        auto=AutoValues(optimizer_lr=0.25),
    )
    assert cfg.scheduler.lr_scheduler_params["warmup_max_lr"] == 0.25
    with pytest.raises(
        ConfigError, match=r"scheduler.params.total_num_steps: cannot resolve 'auto'"
    ):
        load(
            {
                "train_batch_size": 1,
                "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}},
            }
        )


# ---- unknown, unsupported, wrong


def test_unknown_keys_are_warnings_with_suggestions(tmp_path):
    # Issue 19: inside a known section an unknown key is now an error by default; with
    # unknown_keys="warn" it is the warning this test checks (the top level always warns).
    ds = {
        "train_batch_size": 2,
        "gradient_clippin": 1.0,
        "zero_optimization": {"stage": 1, "reduce_bucket_sise": 5},
        "optimizer": {"type": "Adam", "params": {"lr": 0.1, "wieght_decay": 0.1}},
    }
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds, indent=2))
    cfg, _ = load_deepspeed_config(path, unknown_keys="warn")
    text = "\n".join(cfg.warnings)
    assert (
        "unknown DeepSpeed key 'gradient_clippin' ignored (did you mean 'gradient_clipping'?)"
        in text
    )
    assert "'zero_optimization.reduce_bucket_sise' ignored (did you mean " in text
    assert "'zero_optimization.reduce_bucket_size'" in text
    assert (
        "'optimizer.params.wieght_decay' ignored (did you mean 'optimizer.params.weight_decay'"
        in text
    )
    assert f"{path}:3: unknown DeepSpeed key 'gradient_clippin'" in text  # file:line
    assert cfg.optimizer.clip_grad == 1.0  # the misspelt key did nothing: the default


@pytest.mark.parametrize(
    "ds,match",
    [
        ({"optimizer": {"type": "OneBitAdam", "params": {}}}, "OneBitAdam is not supported"),
        ({"optimizer": {"type": "OneBitLamb"}}, "OneBitLamb is not supported"),
        ({"optimizer": {"type": "ZeroOneAdam"}}, "ZeroOneAdam is not supported"),
        (
            {"optimizer": {"type": "Adagrad", "params": {"lr_decay": 0.1}}},
            "lr_decay is not implemented",
        ),
        (
            {"optimizer": {"type": "Adagrad", "params": {"initial_accumulator_value": 0.1}}},
            "initial_accumulator_value is not implemented",
        ),
        (
            {"optimizer": {"type": "Adagrad", "params": {"amsgrad": True}}},
            "AMSGrad is not implemented",
        ),
        ({"curriculum_learning": {"enabled": True}}, "curriculum learning is not implemented"),
        ({"compression_training": {"weight_quantization": {}}}, "Compression is not implemented"),
        ({"amp": {"enabled": True}}, "apex AMP is not supported"),
        ({"hybrid_engine": {"enabled": True}}, "drop --enable_hybrid_engine"),
        ({"zero_optimization": {"stage": 2, "zero_quantized_weights": True}}, "ZeRO\\+\\+"),
        (
            {"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}},
            "masters are always fp32",
        ),
        (
            {
                "zero_optimization": {
                    "stage": 1,
                    "offload_optimizer": {"device": "cpu", "ratio": 0.5},
                }
            },
            "ratio",
        ),
    ],
)
def test_unsupported_features_say_so(ds, match):
    with pytest.raises(UnsupportedError, match=match):
        load({"train_batch_size": 2, **ds})


def test_disabled_unsupported_sections_pass():
    cfg, _ = load(
        {
            "train_batch_size": 2,
            "curriculum_learning": {"enabled": False},
            "amp": {"enabled": False},
        }
    )
    assert cfg.warnings == []


def test_zero_stage_3_with_pipeline_is_unsupported():
    with pytest.raises(UnsupportedError, match="ZeRO stage 3 with pipeline parallelism"):
        load(
            {"train_batch_size": 4, "zero_optimization": {"stage": 3}},
            4,
            pipeline_model_parallel_size=2,
        )
    with pytest.raises(UnsupportedError, match="ZeRO stage 2 with pipeline parallelism"):
        load(
            {"train_batch_size": 4, "zero_optimization": {"stage": 2}},
            4,
            pipeline_model_parallel_size=2,
        )
    cfg, _ = load(
        {"train_batch_size": 4, "zero_optimization": {"stage": 1}},
        4,
        pipeline_model_parallel_size=2,
    )
    assert cfg.zero.zero_stage == 1
    with pytest.raises(UnsupportedError, match="Lamb under ZeRO"):
        load(
            {
                "train_batch_size": 4,
                "optimizer": {"type": "Lamb"},
                "zero_optimization": {"stage": 1},
            }
        )


@pytest.mark.parametrize(
    "ds,message",
    [
        (
            {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "gpu"}}},
            "zero_optimization.offload_optimizer.device: 'gpu' is not one of none, cpu, nvme",
        ),
        (
            {"zero_optimization": {"stage": 4}},
            "zero_optimization.stage: 4 is not one of 0, 1, 2, 3",
        ),
        (
            {"zero_optimization": {"reduce_bucket_size": 1.5}},
            "zero_optimization.reduce_bucket_size: 1.5 is not an integer",
        ),
        (
            {"zero_optimization": {"reduce_bucket_size": -5}},
            "zero_optimization.reduce_bucket_size: -5 is not positive",
        ),
        ({"fp16": {"enabled": "yes"}}, "fp16.enabled: 'yes' is not true or false"),
        ({"fp16": {"hysteresis": "two"}}, "fp16.hysteresis: 'two' is not an integer"),
        ({"gradient_clipping": "much"}, "gradient_clipping: 'much' is not a number"),
        (
            {"optimizer": {"type": "Adam", "params": {"betas": [0.9]}}},
            "optimizer.params.betas: [0.9] is not a pair",
        ),
        ({"optimizer": {"type": "Adamm"}}, "optimizer.type: unknown optimizer 'Adamm'"),
        ({"scheduler": {"type": "WarmupLr"}}, "scheduler.type: 'WarmupLr' is not one of WarmupLR"),
        (
            {"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cubic"}}},
            "scheduler.params.warmup_type: 'cubic' is not one of log, linear",
        ),
        (
            {"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.1}}},
            "scheduler.params.cycle_max_lr is required",
        ),
        ({"zero_optimization": 3}, "zero_optimization: expected an object of keys, got 3"),
        (
            {"checkpoint": {"tag_validation": "maybe"}},
            "checkpoint.tag_validation: 'maybe' is not one of Ignore, Warn, Fail",
        ),
        (
            {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "nvme"}}},
            "offload_optimizer.device 'nvme' needs nvme_path",
        ),
        (
            {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
            "needs ZeRO stage 1, 2 or 3",
        ),
    ],
)
def test_wrong_values_name_their_key_path(ds, message):
    with pytest.raises(ConfigError) as e:
        load({"train_batch_size": 2, **ds})
    assert message in str(e.value)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_offload_param_below_stage_3_is_ignored_with_a_warning(stage):
    # DeepSpeed reads offload_param at stage 3 only.
    zero = {"stage": stage, "offload_param": {"device": "cpu"}}
    cfg, _ = load({"train_batch_size": 2, "zero_optimization": zero})
    assert not cfg.zero.offload_param
    assert any("offload_param.device 'cpu' is ignored at ZeRO stage" in w for w in cfg.warnings)


def test_error_names_file_and_line(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(
        '{\n  "train_batch_size": 2,\n  "zero_optimization": {\n    "stage": "x"\n  }\n}\n'
    )
    with pytest.raises(
        ConfigError, match=rf"{path}:4: zero_optimization.stage: 'x' is not an integer"
    ):
        load_deepspeed_config(path)


def test_legacy_spellings():
    keys = deepspeed_keys(
        {
            "train_batch_size": 2,
            "zero_optimization": {
                "stage": 3,
                "cpu_offload": True,
                "stage3_gather_fp16_weights_on_model_save": True,
            },
        }
    )
    z = keys.nested["zero"]
    assert z["offload_optimizer_device"] == "cpu"
    assert z["stage3_gather_16bit_weights_on_model_save"] is True


# ---- zerotron pretrain: --deepspeed --deepspeed_config, --zero-stage; precedence

BASE = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 16 --train-iters 10 "


def test_pretrain_flags_and_deepspeed_config(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps({**FULL, "zero_optimization": {"stage": 2, "reduce_bucket_size": 1000}})
    )
    cfg = parse_megatron_args(
        shlex.split(BASE + f"--deepspeed --deepspeed_config {path}"), world_size=4
    )
    assert cfg.zero.zero_stage == 2 and cfg.zero.reduce_bucket_size == 1000
    assert cfg.optimizer.lr == 3e-4 and cfg.training.global_batch_size == 32
    # flag > config file > default
    cfg = parse_megatron_args(
        shlex.split(
            BASE
            + f"--deepspeed_config {path} --zero-stage 1 --lr 0.01 --clip-grad 2 --no-overlap-comm"
        ),
        world_size=4,
    )
    assert (cfg.zero.zero_stage, cfg.optimizer.lr, cfg.optimizer.clip_grad) == (1, 0.01, 2.0)
    assert cfg.zero.overlap_comm is False
    # --zero-stage alone, with the offload flag
    cfg = parse_megatron_args(
        shlex.split(
            BASE + "--micro-batch-size 2 --lr 1e-3 --zero-stage 2 --zero-offload-optimizer cpu"
        ),
        world_size=2,
    )
    assert (cfg.zero.zero_stage, cfg.zero.offload_optimizer_device) == (2, "cpu")
    assert cfg.optimizer.clip_grad == 1.0  # no DeepSpeed config: Megatron's default
    # Megatron's distributed optimizer is ZeRO stage 1
    flags = BASE + "--micro-batch-size 2 --lr 1e-3 --use-distributed-optimizer"
    cfg = parse_megatron_args(shlex.split(flags), world_size=2)
    assert cfg.zero.zero_stage == 1
    with pytest.raises(ConfigError, match="--zero-stage"):
        parse_megatron_args(shlex.split(BASE + "--micro-batch-size 2 --lr 1 --zero-stage 5"))


TINY = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --split 80,10,10 --log-interval 1 "
    "--eval-interval 100 --eval-iters 0 --seed 1234 --train-iters 3 --hidden-dropout 0 "
    "--attention-dropout 0 --num-workers 0 "
)


def test_pretrain_trains_with_zero_from_flags_and_deepspeed_config(
    data_prefix, tmp_path, monkeypatch
):
    """One process: ZeRO stages 1 and 2 (flag, then DeepSpeed JSON with its own scheduler)
    follow the stage-0 run's losses (one rank: the same arithmetic on flat partitions)."""
    import zerotron.training.pretrain as pretrain_module
    from zerotron.training.build import build_run

    built = []

    def spy(cfg, **kw):
        run = build_run(cfg, **kw)
        built.append(run.engine)
        return run

    monkeypatch.setattr(pretrain_module, "build_run", spy)

    def run(extra: str) -> list[float]:
        cfg = parse_megatron_args(shlex.split(TINY + f"--data-path {data_prefix} " + extra))
        return list(pretrain_module.pretrain(cfg).losses.values())

    base = run("")
    zero1 = run("--zero-stage 1")
    assert built[-1].zero_optimization_stage() == 1
    assert zero1 == pytest.approx(base, rel=1e-5)
    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps(
            {
                "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e4},
                "gradient_clipping": 1.0,
                "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2}},
            }
        )
    )
    zero2 = run(f"--deepspeed --deepspeed_config {path}")
    engine = built[-1]
    assert engine.zero_optimization_stage() == 2
    assert type(engine.lr_scheduler).__name__ == "WarmupLR" and engine.lr_increment == 1
    assert engine.lr_scheduler.last_batch_iteration == 2  # stepped once per iteration
    assert zero2[0] == pytest.approx(base[0], rel=1e-5)  # the first step runs before any update
    assert all(math.isfinite(x) for x in zero2)


def test_offload_keys_are_checked_by_the_zero_sections_fields():
    """The offload keys' converters and defaults come from ZeroConfig's field definitions (one
    definition of what an offload value may be)."""
    from zerotron.config import ZeroConfig
    from zerotron.config.deepspeed_table import SPEC, Leaf

    for kind in ("optimizer", "param"):
        node = SPEC["zero_optimization"][f"offload_{kind}"]
        for key, leaf in node.items():
            if isinstance(leaf, Leaf):
                assert leaf.field == f"offload_{kind}_{key}"
                assert leaf.default == ZeroConfig.model_fields[leaf.field].default
    with pytest.raises(ConfigError, match="offload_param.buffer_size: 0 is not positive"):
        load({"train_batch_size": 2, "zero_optimization": {"offload_param": {"buffer_size": 0}}})
    with pytest.raises(ConfigError, match="offload_param.max_in_cpu: -1 is not zero or positive"):
        load({"train_batch_size": 2, "zero_optimization": {"offload_param": {"max_in_cpu": -1}}})


def test_steps_per_print_infinity_means_never():
    # accelerate's DeepSpeedPlugin writes float("inf") to keep DeepSpeed from printing
    cfg, _ = load_deepspeed_config({"train_batch_size": 1, "steps_per_print": math.inf})
    assert cfg.training.log_interval >= 2**62
