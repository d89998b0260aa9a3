"""DeepSpeed's ``deepspeed.runtime.zero.stage_1_and_2`` memory estimators for ZeRO-2: print
DeepSpeed's table of model-states memory per CPU and per GPU, with and without
``offload_optimizer`` (numbers from :func:`zerotron.tuning.zero_memory.zero2_model_states_mem`).
"""

from __future__ import annotations

from torch import nn

from zerotron.compat.runtime.zero.estimates import device, header, row
from zerotron.tuning.zero_memory import model_params, zero2_model_states_mem


def estimate_zero2_model_states_mem_needs_all_live(
    model: nn.Module,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    additional_buffer_factor: float = 1.5,
) -> None:
    """Print the ZeRO-2 estimates for ``model`` (its parameters counted, tied ones once)."""
    total_params, _ = model_params(model)
    estimate_zero2_model_states_mem_needs_all_cold(
        total_params, num_gpus_per_node, num_nodes, additional_buffer_factor
    )


def estimate_zero2_model_states_mem_needs_all_cold(
    total_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    additional_buffer_factor: float = 1.5,
) -> None:
    """Print the ZeRO-2 estimates for a model of ``total_params`` parameters."""
    print(header(num_nodes, num_gpus_per_node, f"{int(total_params / 1e6)}M total params."))
    for cpu_offload in (True, False):
        estimate = zero2_model_states_mem(
            total_params, num_gpus_per_node, num_nodes, cpu_offload, additional_buffer_factor
        )
        print(row(estimate, {"offload_optimizer": device(cpu_offload)}))
