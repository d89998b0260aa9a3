"""Distributed foundations: rank grid, process start, process groups, communication, RNG streams.

- :mod:`~zerotron.distributed.topology`: :class:`ProcessTopology`, the pure (pp, dp, tp) rank
  grid every process group is built from.
- :mod:`~zerotron.distributed.init`: :func:`init_distributed` (env:// rendezvous, backend,
  device, timeout).
- :mod:`~zerotron.distributed.state`: :func:`initialize_model_parallel` and :func:`state`, the
  one :class:`ParallelState` with this rank's groups (``group_of``: the Group of a torch group).
- :mod:`~zerotron.distributed.comm`: every collective and p2p call, recorded in the byte
  ``ledger`` (:mod:`~zerotron.distributed.ledger`).
- :mod:`~zerotron.distributed.mpu`: Megatron/DeepSpeed names over the state.
- :mod:`~zerotron.distributed.rng`: the tensor-parallel RNG tracker.

Note: ``zerotron.distributed.state`` here is the *function*; import from the module with
``from zerotron.distributed.state import ...``.
"""

from zerotron.distributed import comm, mpu
from zerotron.distributed.comm import Group, Ledger, ledger
from zerotron.distributed.init import (
    destroy,
    get_rank,
    get_world_size,
    init_distributed,
    is_initialized,
    local_rank,
)
from zerotron.distributed.rng import (
    RNGStatesTracker,
    get_rng_tracker,
    model_parallel_cuda_manual_seed,
    model_parallel_seed,
)
from zerotron.distributed.state import (
    ParallelState,
    destroy_model_parallel,
    initialize_model_parallel,
    is_model_parallel_initialized,
    state,
)
from zerotron.distributed.topology import AXES, GROUP_NAMES, Coords, ProcessTopology

__all__ = [
    "AXES",
    "GROUP_NAMES",
    "Coords",
    "Group",
    "Ledger",
    "ParallelState",
    "ProcessTopology",
    "RNGStatesTracker",
    "comm",
    "destroy",
    "destroy_model_parallel",
    "get_rank",
    "get_rng_tracker",
    "get_world_size",
    "init_distributed",
    "initialize_model_parallel",
    "is_initialized",
    "is_model_parallel_initialized",
    "ledger",
    "local_rank",
    "model_parallel_cuda_manual_seed",
    "model_parallel_seed",
    "mpu",
    "state",
]
