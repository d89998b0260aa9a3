"""``deepspeed.comm``: DeepSpeed's communication API over zerotron's one comm layer.

``from zerotron import comm as dist`` (DeepSpeed: ``from deepspeed import comm as dist``) gives
torch.distributed's functions with DeepSpeed's signatures and defaults: ``group=None`` is the
world, DeepSpeed's ``ReduceOp`` and torch's are both accepted, ``async_op=True`` returns a
handle with ``wait()``, and DeepSpeed's profiling keywords (``prof``, ``log_name``, ``debug``)
are accepted. Every transfer goes through :mod:`zerotron.distributed.comm`, so the ledger
records it. The functions live in :mod:`~zerotron.compat.comm.comm` (DeepSpeed's module path),
the rooted collectives in :mod:`~zerotron.compat.comm.rooted`, the list and batch forms in
:mod:`~zerotron.compat.comm.batched`, and ``TorchBackend`` in :mod:`~zerotron.compat.comm.torch`.
"""

from zerotron.compat.comm.batched import (
    P2POp,
    all_gather_coalesced,
    all_reduce_coalesced,
    all_to_all,
    batch_isend_irecv,
    has_all_reduce_coalesced,
    has_coalescing_manager,
    reduce_scatter,
)
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
from zerotron.compat.comm.rooted import (
    gather,
    inference_all_reduce,
    monitored_barrier,
    reduce,
    scatter,
)
from zerotron.compat.comm.torch import TorchBackend
from zerotron.compat.submodules import submodule_getattr

__all__ = [
    "P2POp",
    "ReduceOp",
    "TorchBackend",
    "Work",
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "allgather_fn",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "destroy_process_group",
    "gather",
    "get_all_ranks_from_group",
    "get_global_rank",
    "get_local_rank",
    "get_rank",
    "get_world_group",
    "get_world_size",
    "has_all_gather_into_tensor",
    "has_all_reduce_coalesced",
    "has_coalescing_manager",
    "has_reduce_scatter_tensor",
    "inference_all_reduce",
    "init_distributed",
    "irecv",
    "is_available",
    "is_initialized",
    "isend",
    "monitored_barrier",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_fn",
    "reduce_scatter_tensor",
    "scatter",
    "send",
]

__getattr__ = submodule_getattr(__name__)
