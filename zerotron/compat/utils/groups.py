"""DeepSpeed's ``deepspeed.utils.groups``: the process-group getters, over zerotron's one
:class:`~zerotron.distributed.state.ParallelState` (through :mod:`zerotron.distributed.mpu`,
whose groups are torch ProcessGroups).

DeepSpeed's meanings: ``get_model_parallel_*`` here are the *tensor*-parallel group (as in
DeepSpeed's groups module; ``zerotron.distributed.mpu.get_model_parallel_*`` is tensor ×
pipeline, Megatron's meaning), ``_get_model_parallel_world_size`` is tensor × pipeline (what
an ``mpu`` passed to DeepSpeed answers). zerotron's sequence parallelism is Megatron's (inside
the tensor-parallel group), so DeepSpeed's Ulysses sequence-parallel group has size 1 and the
sequence-data-parallel group is the data-parallel group. There are no expert groups yet.
"""

from __future__ import annotations

from typing import Any

from zerotron.distributed import mpu
from zerotron.distributed.state import state

# Tensor parallel (DeepSpeed: "model parallel" in this module).
get_tensor_model_parallel_group = mpu.get_tensor_model_parallel_group
get_tensor_model_parallel_world_size = mpu.get_tensor_model_parallel_world_size
get_tensor_model_parallel_rank = mpu.get_tensor_model_parallel_rank
get_tensor_model_parallel_src_rank = mpu.get_tensor_model_parallel_src_rank
get_model_parallel_group = mpu.get_tensor_model_parallel_group
get_model_parallel_world_size = mpu.get_tensor_model_parallel_world_size
get_model_parallel_rank = mpu.get_tensor_model_parallel_rank

# Data parallel.
get_data_parallel_group = mpu.get_data_parallel_group
get_data_parallel_world_size = mpu.get_data_parallel_world_size
get_data_parallel_rank = mpu.get_data_parallel_rank
_get_data_parallel_group = mpu.get_data_parallel_group
_get_data_parallel_world_size = mpu.get_data_parallel_world_size
_get_data_parallel_rank = mpu.get_data_parallel_rank
_get_sequence_data_parallel_group = mpu.get_data_parallel_group
_get_sequence_data_parallel_world_size = mpu.get_data_parallel_world_size
_get_sequence_data_parallel_rank = mpu.get_data_parallel_rank


def _get_data_parallel_group_ranks() -> list[int]:
    """Global ranks of this rank's data-parallel group, in group order."""
    return list(state().dp.ranks)


def _get_broadcast_src_rank() -> int:
    """Global rank of the first member of this rank's (sequence-)data-parallel group."""
    return state().dp.global_rank(0)


def _get_model_parallel_world_size() -> int:
    """Ranks holding one model replica: tensor × pipeline."""
    return state().mp.size


def _get_sequence_parallel_world_size() -> int:
    """DeepSpeed's (Ulysses) sequence parallelism: not used by zerotron, so 1."""
    return 1


def _get_sequence_parallel_rank() -> int:
    return 0


def _get_sequence_parallel_group() -> Any:
    """DeepSpeed raises KeyError when there is no sequence-parallel group; so does this."""
    raise KeyError("No sequence parallel group found")


__all__ = [
    "_get_broadcast_src_rank",
    "_get_data_parallel_group",
    "_get_data_parallel_group_ranks",
    "_get_data_parallel_rank",
    "_get_data_parallel_world_size",
    "_get_model_parallel_world_size",
    "_get_sequence_data_parallel_group",
    "_get_sequence_data_parallel_rank",
    "_get_sequence_data_parallel_world_size",
    "_get_sequence_parallel_group",
    "_get_sequence_parallel_rank",
    "_get_sequence_parallel_world_size",
    "get_data_parallel_group",
    "get_data_parallel_rank",
    "get_data_parallel_world_size",
    "get_model_parallel_group",
    "get_model_parallel_rank",
    "get_model_parallel_world_size",
    "get_tensor_model_parallel_group",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_src_rank",
    "get_tensor_model_parallel_world_size",
]
