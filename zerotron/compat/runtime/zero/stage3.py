"""DeepSpeed's ``deepspeed.runtime.zero.stage3`` memory estimators for ZeRO-3: print
DeepSpeed's table of model-states memory per CPU and per GPU for each combination of
``offload_param``, ``offload_optimizer`` and ``zero.Init`` (numbers from
:func:`zerotron.tuning.zero_memory.zero3_model_states_mem`).
"""

from __future__ import annotations

from torch import nn

from zerotron.compat.runtime.zero.estimates import device, header, row
from zerotron.tuning.zero_memory import model_params, zero3_model_states_mem


def estimate_zero3_model_states_mem_needs_all_live(
    model: nn.Module,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    additional_buffer_factor: float = 1.5,
) -> None:
    """Print the ZeRO-3 estimates for ``model`` (its parameters counted, tied ones once; the
    largest layer is the module with the most parameters of its own)."""
    total_params, largest_layer_params = model_params(model)
    estimate_zero3_model_states_mem_needs_all_cold(
        total_params, largest_layer_params, num_gpus_per_node, num_nodes, additional_buffer_factor
    )


def estimate_zero3_model_states_mem_needs_all_cold(
    total_params: int,
    largest_layer_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    additional_buffer_factor: float = 1.5,
) -> None:
    """Print the ZeRO-3 estimates for a model of ``total_params`` parameters whose largest
    layer has ``largest_layer_params``."""
    model = (
        f"{int(total_params / 1e6)}M total params, "
        f"{int(largest_layer_params / 1e6)}M largest layer params."
    )
    print(header(num_nodes, num_gpus_per_node, model))
    for cpu_offload, cpu_offload_params in ((True, True), (True, False), (False, False)):
        for zero_init in (True, False):
            estimate = zero3_model_states_mem(
                total_params,
                largest_layer_params,
                num_gpus_per_node,
                num_nodes,
                cpu_offload,
                cpu_offload_params,
                zero_init,
                additional_buffer_factor,
            )
            options = {
                "offload_param": device(cpu_offload_params),
                "offload_optimizer": device(cpu_offload),
                "zero_init": str(int(zero_init)),
            }
            print(row(estimate, options))
