"""The ``parallel`` section: the process grid (world = pipeline x data x tensor parallel),
pipeline schedule and virtual stages, collective timeouts."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from zerotron.config.sections.base import Int, Section


class ParallelConfig(Section):
    """The process grid: world = pipeline x data x tensor parallel."""

    tensor_model_parallel_size: Int = Field(1, ge=1, description="Tensor-parallel size.")
    pipeline_model_parallel_size: Int = Field(1, ge=1, description="Pipeline-parallel size.")
    no_pipeline_parallel: bool = Field(
        False, description="Megatron-DeepSpeed's: no pipeline (the pipeline size must be 1)."
    )
    sequence_parallel: bool = Field(
        False, description="Shard LayerNorm and dropout along the sequence (needs TP > 1)."
    )
    num_layers_per_virtual_pipeline_stage: Int | None = Field(
        None, gt=0, description="Layers per virtual stage: interleaved 1F1B schedule."
    )
    virtual_pipeline_model_parallel_size: Int | None = Field(
        None,
        gt=0,
        description="Virtual stages per pipeline rank; derived from "
        "num_layers_per_virtual_pipeline_stage.",
    )
    pipeline_schedule: Literal["1f1b", "gpipe", "interleaved"] | None = Field(
        None,
        description="Pipeline schedule (zerotron's flag; Megatron has none): 1f1b by default, "
        "interleaved with virtual stages, gpipe (all forwards, then all backwards) on request.",
    )
    variable_seq_lengths: bool = Field(
        False,
        description="Send each pipeline activation's shape at every step, for micro-batches "
        "whose shapes change (Megatron's flag); by default shapes go once, at the first step.",
    )
    distributed_timeout_minutes: Int = Field(
        10, gt=0, description="Timeout of collectives; a hung rank fails the job after it."
    )
    ddp_bucket_size: Int | None = Field(
        None, gt=0, description="Elements per data-parallel gradient bucket."
    )
    world_size: Int = Field(1, ge=1, description="Number of processes; set by the launcher.")
    data_parallel_size: Int | None = Field(
        None, ge=1, description="world_size / (tensor x pipeline size); derived."
    )
