"""The ``zero`` section: ZeRO stages, gradient reduction and offload (DeepSpeed's
zero_optimization and its top-level gradient keys, with DeepSpeed's defaults).

The offload fields are the one definition of the offload keys (``offload_optimizer`` /
``offload_param``: device, nvme_path, pin_memory, buffer_count, buffer_size, max_in_cpu): the
DeepSpeed loader derives its converters for them from these fields (``zero.Init``'s and
Python-built :class:`~zerotron.zero.options.OffloadOptions` are checked by the same converters),
and the rules between them (a stage to offload from, a path for NVMe) are in
:mod:`zerotron.config.derive`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from zerotron.config.sections.base import Float, Int, Section

OffloadDevice = Literal["none", "cpu", "nvme"]


class ZeroConfig(Section):
    """ZeRO and the data-parallel gradient reduction (DeepSpeed's zero_optimization and the
    top-level keys about reducing gradients). Defaults are DeepSpeed's."""

    zero_stage: Int = Field(
        0,
        ge=0,
        le=3,
        description="ZeRO stage: 0 plain data parallelism, 1 optimizer states, 2 + gradients, "
        "3 + parameters partitioned over the data-parallel ranks.",
    )
    allgather_partitions: bool = Field(
        True, description="All-gather updated parameters in one call (not broadcasts)."
    )
    allgather_bucket_size: Int = Field(
        500_000_000, gt=0, description="Elements all-gathered at a time."
    )
    overlap_comm: bool | None = Field(
        None,
        description="Overlap gradient reduction with backward; default on for stage 3, off "
        "otherwise (DeepSpeed's).",
    )
    reduce_scatter: bool = Field(
        True, description="Reduce gradients with reduce-scatter (not all-reduce)."
    )
    reduce_bucket_size: Int | None = Field(
        None,
        gt=0,
        description="Elements reduced at a time; unset: 4e6 at stage 3, 5e8 at stages 1-2 "
        "(a DeepSpeed config's default is 5e8).",
    )
    contiguous_gradients: bool = Field(
        True, description="Copy reduced gradients into one contiguous buffer."
    )
    round_robin_gradients: bool = Field(
        False, description="Stage 1/2: assign gradients to partitions round-robin."
    )
    offload_optimizer_device: OffloadDevice = Field(
        "none", description="Where fp32 master weights and optimizer states live: none, cpu, nvme."
    )
    offload_optimizer_nvme_path: str | None = Field(
        None, description="Directory for optimizer states offloaded to NVMe."
    )
    offload_optimizer_pin_memory: bool = Field(
        False, description="Pin the host memory of offloaded optimizer states."
    )
    offload_optimizer_buffer_count: Int = Field(
        4, gt=0, description="Buffers streaming optimizer states from NVMe."
    )
    offload_param_device: OffloadDevice = Field(
        "none", description="Stage 3: where partitioned 16-bit parameters live: none, cpu, nvme."
    )
    offload_param_nvme_path: str | None = Field(
        None, description="Directory for parameters offloaded to NVMe."
    )
    offload_param_pin_memory: bool = Field(
        False, description="Pin the host memory of offloaded parameters."
    )
    offload_param_buffer_count: Int = Field(
        5, gt=0, description="Buffers streaming parameters from NVMe."
    )
    offload_param_buffer_size: Int = Field(
        100_000_000, gt=0, description="Elements per parameter buffer (NVMe)."
    )
    offload_param_max_in_cpu: Int = Field(
        1_000_000_000, ge=0, description="Parameter elements kept in host memory (NVMe)."
    )
    sub_group_size: Int | None = Field(
        None,
        gt=0,
        description="Elements per optimizer sub-group stepped at a time (offload streams them); "
        "unset: 2e6 at stage 3, 1e9 at stages 1-2 (a DeepSpeed config's default is 1e9).",
    )
    stage3_prefetch_bucket_size: Int | None = Field(
        None,
        ge=0,
        description="Stage 3: parameter elements fetched ahead of use; unset: the next module "
        "only (a DeepSpeed config's default is 5e7).",
    )
    stage3_param_persistence_threshold: Int = Field(
        100_000, ge=0, description="Stage 3: parameters this small stay whole (not partitioned)."
    )
    stage3_max_live_parameters: Int = Field(
        1_000_000_000, ge=0, description="Stage 3: gathered parameter elements kept at most."
    )
    stage3_max_reuse_distance: Int = Field(
        0,
        ge=0,
        description="Stage 3: keep a parameter gathered from its forward use to its next use "
        "when fewer parameter elements are fetched in between; 0: release after every use (a "
        "DeepSpeed config's default is 1e9).",
    )
    stage3_gather_16bit_weights_on_model_save: bool = Field(
        False, description="Stage 3: save consolidated 16-bit weights with each checkpoint."
    )
    zero_force_ds_cpu_optimizer: bool = Field(
        True, description="With offload to cpu, step with the built-in CPU optimizer."
    )
    prescale_gradients: bool = Field(
        False, description="Divide gradients by the data-parallel size before reducing them."
    )
    gradient_predivide_factor: Float = Field(
        1.0, gt=0, description="Divide gradients by this before reducing, the rest after."
    )
    communication_data_type: Literal["fp32", "fp16", "bf16"] | None = Field(
        None, description="dtype of gradients on the wire; the parameters' dtype when not given."
    )

    @property
    def offload_optimizer(self) -> bool:
        return self.offload_optimizer_device != "none"

    @property
    def offload_param(self) -> bool:
        return self.offload_param_device != "none"
