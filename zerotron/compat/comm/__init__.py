"""``deepspeed.comm``: DeepSpeed's communication API over zerotron's one comm layer.

``from zerotron import comm as dist`` (DeepSpeed: ``from deepspeed import comm as dist``) gives
torch.distributed's functions with DeepSpeed's signatures and defaults: ``group=None`` is the
world, DeepSpeed's ``ReduceOp`` and torch's are both accepted, ``async_op=True`` returns a
handle with ``wait()``, and DeepSpeed's profiling keywords (``prof``, ``log_name``, ``debug``)
are accepted. Every transfer goes through :mod:`zerotron.distributed.comm`, so the ledger
records it. The functions live in :mod:`~zerotron.compat.comm.comm` (DeepSpeed's module path).
"""

from zerotron.compat.comm.comm import (
    Work,
    all_gather,
    all_gather_into_tensor,
    all_reduce,
    all_to_all_single,
    allgather_fn,
    barrier,
    broadcast,
    destroy_process_group,
    get_all_ranks_from_group,
    get_global_rank,
    get_local_rank,
    get_rank,
    get_world_group,
    get_world_size,
    has_all_gather_into_tensor,
    has_reduce_scatter_tensor,
    init_distributed,
    irecv,
    is_available,
    is_initialized,
    isend,
    new_group,
    recv,
    reduce_scatter_fn,
    reduce_scatter_tensor,
    send,
)
from zerotron.compat.comm.reduce_op import ReduceOp
from zerotron.compat.submodules import submodule_getattr

__all__ = [
    "ReduceOp",
    "Work",
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "all_to_all_single",
    "allgather_fn",
    "barrier",
    "broadcast",
    "destroy_process_group",
    "get_all_ranks_from_group",
    "get_global_rank",
    "get_local_rank",
    "get_rank",
    "get_world_group",
    "get_world_size",
    "has_all_gather_into_tensor",
    "has_reduce_scatter_tensor",
    "init_distributed",
    "irecv",
    "is_available",
    "is_initialized",
    "isend",
    "new_group",
    "recv",
    "reduce_scatter_fn",
    "reduce_scatter_tensor",
    "send",
]

__getattr__ = submodule_getattr(__name__)
