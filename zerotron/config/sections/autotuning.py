"""DeepSpeed's ``autotuning`` block: what the autotuner (``zerotron tune``) searches and how an
experiment measures itself.

The engine reads ``autotuning_enabled``, the profile steps, ``autotuning_metric`` and
``autotuning_metric_path`` (:mod:`zerotron.engine.autotuning_metrics`): an enabled run measures
the steps after ``start_profile_step`` up to ``end_profile_step``, writes the metric JSON and
ends. The model-info keys make it a profiling run instead (parameters, activation memory).
The rest is read by the tuner (:mod:`zerotron.tuning.tune`). Defaults are DeepSpeed's
(``deepspeed/autotuning/constants.py``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from zerotron.config.sections.base import Int, Section

METRICS = ("throughput", "latency", "flops")
TUNERS = ("gridsearch", "random", "model_based")


class AutotuningConfig(Section):
    """DeepSpeed's ``autotuning`` section, key for key (each field is ``autotuning_<key>``)."""

    autotuning_enabled: bool = Field(
        False, description="Measure this run for the autotuner and end it after the profile."
    )
    autotuning_fast: bool = Field(
        True, description="Tune ZeRO stage and micro-batch only (false: also ZeRO's knobs)."
    )
    autotuning_results_dir: str = Field(
        "autotuning_results", description="Where the tuner writes results and the best config."
    )
    autotuning_exps_dir: str = Field(
        "autotuning_exps", description="Where the tuner writes each experiment's description."
    )
    autotuning_overwrite: bool = Field(
        True, description="Remove earlier results_dir and exps_dir before tuning."
    )
    autotuning_metric: Literal["throughput", "latency", "flops"] = Field(
        "throughput", description="What the tuner optimizes."
    )
    autotuning_start_profile_step: Int = Field(
        3, ge=0, description="Steps before the measured ones (warm-up)."
    )
    autotuning_end_profile_step: Int = Field(
        5, gt=0, description="The last measured step; the run ends after it."
    )
    autotuning_metric_path: str | None = Field(
        None,
        description="Where an enabled run writes its metric JSON "
        "(default: ./autotuning_metric.json).",
    )
    autotuning_model_info_path: str | None = Field(
        None,
        description="Where a profiling run writes the model info "
        "(default: ./autotuning_model_info.json).",
    )
    autotuning_model_info_profile: bool = Field(
        False, description="Profile the model (parameters, activation memory) and end the run."
    )
    autotuning_model_info_num_params: Int | None = Field(
        None, gt=0, description="The model's parameter count (skips the profiling run)."
    )
    autotuning_model_info_hidden_size: Int | None = Field(
        None, gt=0, description="The model's hidden size (ZeRO-3 bucket sizes)."
    )
    autotuning_model_info_num_layers: Int | None = Field(
        None, gt=0, description="The model's number of layers."
    )
    autotuning_tuner_type: Literal["gridsearch", "random", "model_based"] = Field(
        "gridsearch", description="How the tuner orders the experiments of a tuning space."
    )
    autotuning_tuner_early_stopping: Int = Field(
        5, gt=0, description="Stop a space after this many experiments without a better one."
    )
    autotuning_tuner_num_trials: Int = Field(
        50, gt=0, description="At most this many experiments per tuning space."
    )
    autotuning_arg_mappings: dict[str, str] | None = Field(
        None, description="DeepSpeed config key -> the script's flag that sets it."
    )
    autotuning_mp_size: Int = Field(1, gt=0, description="Model-parallel size of the script.")
    autotuning_max_train_batch_size: Int | None = Field(
        None, gt=0, description="Largest global batch the tuner may use."
    )
    autotuning_min_train_batch_size: Int = Field(
        1, gt=0, description="Smallest global batch the tuner may use."
    )
    autotuning_max_train_micro_batch_size_per_gpu: Int = Field(
        1024, gt=0, description="Largest micro-batch per rank the tuner tries."
    )
    autotuning_min_train_micro_batch_size_per_gpu: Int = Field(
        1, gt=0, description="Smallest micro-batch per rank the tuner tries."
    )
    autotuning_num_tuning_micro_batch_sizes: Int = Field(
        3, gt=0, description="How many micro-batch sizes the tuner tries per ZeRO stage."
    )

    @model_validator(mode="after")
    def _check(self) -> AutotuningConfig:
        if self.autotuning_end_profile_step <= self.autotuning_start_profile_step:
            raise ValueError(
                f"end_profile_step {self.autotuning_end_profile_step} must be after "
                f"start_profile_step {self.autotuning_start_profile_step} (the steps after "
                "start_profile_step up to end_profile_step are measured)"
            )
        if (
            self.autotuning_min_train_micro_batch_size_per_gpu
            > self.autotuning_max_train_micro_batch_size_per_gpu
        ):
            raise ValueError(
                "min_train_micro_batch_size_per_gpu is above max_train_micro_batch_size_per_gpu"
            )
        return self
