"""DeepSpeed's model-states memory estimates for ZeRO-2 and ZeRO-3, as pure functions.

The numbers are DeepSpeed's (``estimate_zero2_model_states_mem_needs`` and
``estimate_zero3_model_states_mem_needs``), so a user comparing with DeepSpeed's tables sees the
same figures. They count model states only (16-bit parameters and gradients, fp32 masters, Adam's
two moments), per device, with ``additional_buffer_factor`` of head room on the CPU side;
activations and temporary buffers are not included. ``compat/runtime/zero`` prints them in
DeepSpeed's table; the planner of later issues builds on the same per-element byte counts.

Bytes per parameter, mixed precision with Adam (the constants below; the estimator of
:mod:`~zerotron.tuning.estimate` takes its model-state terms from the same ones):

- ``HALF`` (2) for the 16-bit parameters, ``HALF`` for the 16-bit gradients,
- 16 partitioned by ZeRO: ``FP32`` (4) fp32 gradients (ZeRO-2's accumulation), ``FP32`` masters,
  ``ADAM_STATES`` (8: two fp32 moments);

hence DeepSpeed's 18 per parameter (everything but the 16-bit parameters) divided over the GPUs,
and the ZeRO paper's K = 12 (masters and moments; :func:`zero_paper_model_states`).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

HALF = 2
"""Bytes of one 16-bit element (fp16 / bf16 parameters and gradients)."""
FP32 = 4
"""Bytes of one fp32 element (fp32 gradients, master weights)."""
ADAM_STATES = 2 * FP32
"""Adam's two fp32 moments per parameter."""
OPTIMIZER_STATES = {
    "adam": ADAM_STATES,
    "adamw": ADAM_STATES,
    "lamb": ADAM_STATES,
    "lion": FP32,
    "sgd": FP32,
    "adagrad": FP32,
}
"""Bytes of optimizer state per parameter (fp32), by optimizer (SGD: its momentum buffer)."""
DS_PARTITIONED = HALF + FP32 + FP32 + ADAM_STATES
"""DeepSpeed's 18: what its ZeRO-2/3 formulas divide over the GPUs (16-bit and fp32 gradients,
fp32 masters, Adam's moments)."""
DS_OFFLOADED = FP32 + FP32 + ADAM_STATES
"""DeepSpeed's 16 per parameter on the host with ``offload_optimizer`` (fp32 gradients, masters,
moments); 18 with ``offload_param`` too (the 16-bit parameters: :data:`HALF` more)."""
ZERO_PAPER_K = FP32 + ADAM_STATES
"""The ZeRO paper's K for mixed-precision Adam: 12 bytes of optimizer state per parameter."""


def zero_paper_model_states(psi: float, num_gpus: int, stage: int, k: int = ZERO_PAPER_K) -> float:
    """Model-state bytes per device in the ZeRO paper (Rajbhandari et al. 2020, Figure 1).

    ``psi`` parameters, ``num_gpus`` data-parallel devices; stage 0 is the baseline
    ``(2 + 2 + K)Ψ``, stage 1 (P_os) ``2Ψ + 2Ψ + KΨ/N``, stage 2 (P_os+g) ``2Ψ + (2 + K)Ψ/N``,
    stage 3 (P_os+g+p) ``(2 + 2 + K)Ψ/N``. 7.5B parameters on 64 devices: 120, 31.4, 16.6 and
    1.9 GB.
    """
    n = num_gpus
    partitioned = {0: 0, 1: k, 2: HALF + k, 3: HALF + HALF + k}[stage]
    return (HALF + HALF + k - partitioned) * psi + partitioned * psi / n


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes of model states per CPU (host memory of one node's processes) and per GPU."""

    cpu_bytes: int
    gpu_bytes: int


def model_params(model: nn.Module) -> tuple[int, int]:
    """``(total parameters, parameters of the largest module)`` of ``model``.

    Shared (tied) parameters are counted once in the total; a module's own parameters
    (``recurse=False``) make its size, as ZeRO-3 gathers one module's parameters at a time.
    """
    total = sum({id(p): _numel(p) for p in model.parameters()}.values())
    largest = max(
        (sum(_numel(p) for p in m.parameters(recurse=False)) for m in model.modules()), default=0
    )
    return total, largest


def _numel(p: nn.Parameter) -> int:
    """Elements of the whole parameter (a ZeRO-3 parameter's ``data`` is empty at rest)."""
    full = getattr(p, "ds_numel", None)
    return int(full) if full is not None else p.numel()


def zero2_model_states_mem(
    total_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    additional_buffer_factor: float = 1.5,
) -> MemoryEstimate:
    """ZeRO-2 model states per CPU and per GPU (DeepSpeed's formula).

    With ``cpu_offload`` (``offload_optimizer=cpu``) a GPU keeps only the 16-bit parameters and
    the host holds the rest (at least 4 bytes per parameter per GPU of the node, at least 16
    for one process); without, the 18 partitioned bytes per parameter are split over all GPUs
    and the host needs a 4-byte copy per GPU of the node (the model as loaded before ZeRO).
    """
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu = HALF * total_params
        cpu = total_params * max(FP32 * total_gpus, DS_OFFLOADED) * additional_buffer_factor
    else:
        gpu = HALF * total_params + int(DS_PARTITIONED * total_params / total_gpus)
        cpu = total_params * FP32 * num_gpus_per_node * additional_buffer_factor
    return MemoryEstimate(int(cpu), int(gpu))


def zero3_model_states_mem(
    total_params: int,
    largest_layer_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    cpu_offload_params: bool = True,
    zero_init: bool = True,
    additional_buffer_factor: float = 1.5,
) -> MemoryEstimate:
    """ZeRO-3 model states per CPU and per GPU (DeepSpeed's formula).

    A GPU always holds the largest layer gathered (4 bytes per parameter: its 16-bit weights
    and gradients). ``cpu_offload`` is ``offload_optimizer=cpu``, ``cpu_offload_params``
    ``offload_param=cpu``; ``zero_init`` says the model is built partitioned
    (``zero.Init``), so no process ever holds the whole fp32 model on the host.
    """
    total_gpus = num_nodes * num_gpus_per_node
    per_node = 1 / num_nodes
    largest_layer_memory = (HALF + HALF) * largest_layer_params
    if cpu_offload:
        per_param = DS_OFFLOADED + HALF if cpu_offload_params else DS_OFFLOADED
        gpu = largest_layer_memory
        if not cpu_offload_params:
            gpu += int(HALF * total_params / total_gpus)
        if zero_init:
            cpu = total_params * per_param * per_node * additional_buffer_factor
        else:
            per_param_cpu = max(FP32 * num_gpus_per_node, per_param * per_node)
            cpu = total_params * per_param_cpu * additional_buffer_factor
    else:
        gpu = largest_layer_memory + int(DS_PARTITIONED * total_params / total_gpus)
        held = largest_layer_params if zero_init else total_params
        cpu = held * FP32 * num_gpus_per_node * additional_buffer_factor
    return MemoryEstimate(int(cpu), int(gpu))
