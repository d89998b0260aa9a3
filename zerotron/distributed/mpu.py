"""Megatron-LM and DeepSpeed's "mpu" names over :func:`zerotron.distributed.state.state`.

For scripts written against ``megatron.core.parallel_state`` / ``mpu`` and for
``deepspeed.initialize(mpu=...)``: pass this module as the ``mpu``. Groups are torch
ProcessGroups, what such code hands to ``torch.distributed``. A one-rank group is a real
one-rank ProcessGroup, never None, because None means *all ranks* to ``torch.distributed`` (a
gradient "all-reduce over the model-parallel group" would silently sum across data-parallel
ranks); in a single-process run there are no process groups and every group is None.

What "model parallel" means: **tensor × pipeline** (the ranks holding one model replica).
That is what DeepSpeed's own ``PipelineParallelGrid.get_model_parallel_*`` return (its
``ds_model_proc_group``, used to reduce overflow flags and gradient norms over a replica) and
what Megatron-core's ``get_model_parallel_group`` returns. DeepSpeed asks for the tensor-parallel
rank with ``get_tensor_model_parallel_rank`` (or ``get_slice_parallel_rank``, both here). Legacy
Megatron's ``get_model_parallel_rank`` meant the tensor-parallel rank and required pp == 1, where
the two agree.
"""

from __future__ import annotations

from typing import Any

from zerotron.distributed.comm import Group
from zerotron.distributed.state import ParallelState, is_model_parallel_initialized, state
from zerotron.errors import DistributedError


def _pg(s: ParallelState, group: Group) -> Any:
    if not group.is_member:
        raise DistributedError(
            f"rank {s.rank} (pipeline stage {s.pp_rank} of {s.pp_size}) is not in the "
            f"{group.name} group",
            fix="only the first and last pipeline stages take part in embedding reductions",
        )
    if group.pg is not None or s.world_size == 1:
        return group.pg
    if s.self_pg is None:
        raise DistributedError(
            f"no one-rank process group for the {group.name} group of size 1",
            where="mpu",
            fix="call initialize_model_parallel() before using the mpu adapter",
        )
    return s.self_pg


# Tensor model parallel (Megatron) = slice parallel (DeepSpeed).


def get_tensor_model_parallel_rank() -> int:
    return state().tp_rank


def get_tensor_model_parallel_world_size() -> int:
    return state().tp_size


def get_tensor_model_parallel_group() -> Any:
    s = state()
    return _pg(s, s.tp)


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of tensor-parallel rank 0 in this rank's group (broadcast source)."""
    return state().tp.ranks[0]


get_slice_parallel_rank = get_tensor_model_parallel_rank
get_slice_parallel_world_size = get_tensor_model_parallel_world_size
get_slice_parallel_group = get_tensor_model_parallel_group


# Data parallel.


def get_data_parallel_rank() -> int:
    return state().dp_rank


def get_data_parallel_world_size() -> int:
    return state().dp_size


def get_data_parallel_group() -> Any:
    s = state()
    return _pg(s, s.dp)


def get_data_parallel_src_rank() -> int:
    """Global rank of data-parallel rank 0 in this rank's group."""
    return state().dp.ranks[0]


# Pipeline model parallel (Megatron) = pipe parallel (DeepSpeed).


def get_pipeline_model_parallel_rank() -> int:
    return state().pp_rank


def get_pipeline_model_parallel_world_size() -> int:
    return state().pp_size


def get_pipeline_model_parallel_group() -> Any:
    s = state()
    return _pg(s, s.pp)


def get_pipeline_model_parallel_first_rank() -> int:
    return state().pp.ranks[0]


def get_pipeline_model_parallel_last_rank() -> int:
    return state().pp.ranks[-1]


def get_pipeline_model_parallel_next_rank() -> int:
    return state().next_stage_rank


def get_pipeline_model_parallel_prev_rank() -> int:
    return state().prev_stage_rank


def get_virtual_pipeline_model_parallel_world_size() -> int | None:
    return state().virtual_pipeline_size


get_pipe_parallel_rank = get_pipeline_model_parallel_rank
get_pipe_parallel_world_size = get_pipeline_model_parallel_world_size
get_pipe_parallel_group = get_pipeline_model_parallel_group
get_stage_id = get_pipeline_model_parallel_rank


def is_pipeline_first_stage(ignore_virtual: bool = False, virtual_stage: int | None = None) -> bool:
    """First pipeline stage; given ``virtual_stage`` (and not ``ignore_virtual``), its first chunk.

    zerotron keeps no global "current virtual rank" like Megatron's: the pipeline runtime passes
    the chunk it runs as ``virtual_stage``; without it the physical stage decides.
    """
    return state().is_first_stage(None if ignore_virtual else virtual_stage)


def is_pipeline_last_stage(ignore_virtual: bool = False, virtual_stage: int | None = None) -> bool:
    """Last pipeline stage (and, unless ``ignore_virtual``, last chunk ``virtual_stage``)."""
    return state().is_last_stage(None if ignore_virtual else virtual_stage)


# Model parallel = tensor × pipeline (see the module docstring).


def get_model_parallel_rank() -> int:
    return state().mp.rank


def get_model_parallel_world_size() -> int:
    return state().mp.size


def get_model_parallel_group() -> Any:
    s = state()
    return _pg(s, s.mp)


# Embedding (first and last pipeline stage) and the whole world.


def get_embedding_group() -> Any:
    """The group that all-reduces the tied embedding's gradients (first and last stage)."""
    s = state()
    return _pg(s, s.embedding)


def is_rank_in_embedding_group() -> bool:
    return state().in_embedding_group


def get_global_rank() -> int:
    return state().rank


def get_world_size() -> int:
    return state().world_size


model_parallel_is_initialized = is_model_parallel_initialized
