"""``deepspeed.comm.comm``: DeepSpeed's communication functions, through zerotron's comm layer.

Each function takes DeepSpeed's arguments, turns the torch group into a zerotron
:class:`~zerotron.distributed.comm.Group` (:func:`zerotron.distributed.state.group_of`: the
world, one of zerotron's named groups, or a group named after its ranks) and the reduction into
zerotron's name, and calls :mod:`zerotron.distributed.comm`, which records it in the ledger
(nothing on a group of one rank, where every collective is a no-op) and talks to torch. Results
are torch.distributed's: in place, into the output tensors, ``None`` or, with
``async_op=True``, a :class:`Work` to ``wait()`` on. Ranks (``src``, ``dst``) are global ranks,
as in torch. On a group this rank is not in, collectives do nothing and return ``None``, as
torch's do.

:func:`init_distributed` (also ``zerotron.init_distributed``) always leaves a default process
group behind, a group of one in a one-process run, as DeepSpeed's does.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from zerotron.compat.comm.reduce_op import ReduceOp
from zerotron.distributed import comm, init
from zerotron.distributed.comm import Group, Pending
from zerotron.distributed.state import group_of
from zerotron.errors import DistributedError

_INIT_FIX = "call deepspeed.init_distributed() (or deepspeed.initialize()) first"


def _default_timeout() -> timedelta:
    """DeepSpeed's default: 10 minutes, or ``DEEPSPEED_TIMEOUT`` minutes."""
    return timedelta(minutes=int(os.environ.get("DEEPSPEED_TIMEOUT", "10")))


# --------------------------------------------------------------------------------------------
# Process groups


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = 29500,
    verbose: bool = True,
    timeout: timedelta | float | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Create the default process group, as ``deepspeed.init_distributed`` does.

    The job comes from the launcher's environment (``zerotron launch``, ``torchrun``,
    ``deepspeed``); without one (plain ``python script.py``, or ``WORLD_SIZE=1``) this process
    is rank 0 of a group of one. ``dist_backend`` defaults to nccl on CUDA and gloo on CPU;
    ``timeout`` (a timedelta, or minutes) to ``DEEPSPEED_TIMEOUT`` minutes or 10. A group that
    already exists (also one the script created) is kept. ``dist_init_required=False`` asks
    for none and requires one to exist. MPI discovery, ``distributed_port``, ``verbose``,
    ``config``, ``rank`` and ``world_size`` are accepted: the environment says all of it;
    ``init_method`` other than ``env://`` is refused.
    """
    if dist_init_required is False:
        if not dist.is_initialized():
            raise DistributedError(
                "dist_init_required=False, but no process group exists",
                where="init_distributed",
                fix="create the group first, or leave dist_init_required unset",
            )
        return
    if dist.is_initialized():
        return
    if init_method not in (None, "env://"):
        raise DistributedError(
            f"init_method={init_method!r} is not supported; the job is read from the "
            "launcher's environment (env://)",
            where="init_distributed",
            fix="start the job with `zerotron launch` or `torchrun` and drop init_method",
        )
    if timeout is None:
        timeout = _default_timeout()
    minutes = timeout.total_seconds() / 60 if isinstance(timeout, timedelta) else float(timeout)
    init.init_distributed(backend=dist_backend, timeout_minutes=minutes, single_process_group=True)


def is_initialized() -> bool:
    """Whether the default process group exists."""
    return dist.is_available() and dist.is_initialized()


def is_available() -> bool:
    """Whether torch.distributed is built in."""
    return dist.is_available()


def _require_init() -> None:
    if not is_initialized():
        raise DistributedError("no process group exists", where="deepspeed.comm", fix=_INIT_FIX)


def get_rank(group: Any = None) -> int:
    """This process's rank in ``group`` (default: the world); -1 when it is not a member."""
    _require_init()
    return dist.get_rank(group)


def get_world_size(group: Any = None) -> int:
    """The number of ranks in ``group`` (default: the world); -1 when this rank is not in it."""
    _require_init()
    return dist.get_world_size(group)


def get_local_rank() -> int:
    """This process's rank on its node (the launcher's ``LOCAL_RANK``)."""
    _require_init()
    return init.local_rank()


def get_global_rank(group: Any = None, group_rank: int = 0) -> int:
    """The global rank of ``group``'s member ``group_rank`` (default group: the world)."""
    _require_init()
    return dist.get_global_rank(dist.group.WORLD if group is None else group, group_rank)


def get_all_ranks_from_group(group: Any = None) -> list[int]:
    """The global ranks of ``group``, in group order."""
    _require_init()
    return list(group_of(group).ranks)


def get_world_group() -> Any:
    """The default process group (torch's ``group.WORLD``)."""
    _require_init()
    return dist.group.WORLD


def new_group(ranks: Sequence[int]) -> Any:
    """A torch process group of ``ranks``, with the job's timeout (every rank calls it)."""
    _require_init()
    return init.new_group(list(ranks))


def destroy_process_group(group: Any = None) -> None:
    """Destroy ``group``; without one, zerotron's groups and the default group."""
    if group is None:
        init.destroy()
    else:
        dist.destroy_process_group(group)


def has_all_gather_into_tensor() -> bool:
    """Always True: :func:`all_gather_into_tensor` works on every backend."""
    return True


def has_reduce_scatter_tensor() -> bool:
    """Always True: :func:`reduce_scatter_tensor` works on every backend."""
    return True


# --------------------------------------------------------------------------------------------
# Arguments and handles


class Work:
    """An asynchronous operation in flight (torch's ``Work``): :meth:`wait` finishes it."""

    def __init__(self, pending: Pending, then: Callable[[torch.Tensor], None] | None = None):
        self._pending = pending
        self._then = then
        self._done = False

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until the operation is complete (the job's timeout bounds it); True."""
        if not self._done:
            result = self._pending.wait()
            if self._then is not None:
                self._then(result)
            self._done = True
        return True

    def is_completed(self) -> bool:
        """Whether :meth:`wait` has finished the operation."""
        return self._done


def _finish(
    pending: Pending, async_op: bool, then: Callable[[torch.Tensor], None] | None = None
) -> Work | None:
    work = Work(pending, then)
    if async_op:
        return work
    work.wait()
    return None


def _group(group: Any) -> Group | None:
    """The zerotron group of a torch group (None: the world); None when not a member."""
    _require_init()
    g = group_of(group)
    return g if g.is_member else None


def member_index(g: Group, rank: int, op: str) -> int:
    """The index in ``g`` of the global ``rank`` a rooted collective names (``src``/``dst``)."""
    if rank not in g.ranks:
        raise DistributedError(
            f"{op} rooted at rank {rank}, which is not in the group {list(g.ranks)}",
            where=f"deepspeed.comm.{op}",
            fix="src and dst are global ranks of members of the group",
        )
    return g.ranks.index(rank)


_OPS = {op.name: op.name.lower() for op in ReduceOp if op is not ReduceOp.UNUSED}


def _op(op: Any) -> str:
    """zerotron's name of a DeepSpeed or torch ``ReduceOp``."""
    name = getattr(op, "name", None)
    if name not in _OPS:
        raise DistributedError(
            f"unsupported reduce op {op!r}",
            where="deepspeed.comm",
            fix=f"use ReduceOp.{', ReduceOp.'.join(_OPS)} (DeepSpeed's or torch's)",
        )
    return _OPS[name]


def _copy_into(dst: torch.Tensor) -> Callable[[torch.Tensor], None]:
    def then(result: torch.Tensor) -> None:
        if result is not dst:
            dst.copy_(result.reshape(dst.shape))

    return then


# --------------------------------------------------------------------------------------------
# Collectives


def all_reduce(
    tensor: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "all_reduce",
    debug: str | None = None,
) -> Work | None:
    """Reduce ``tensor`` in place over ``group``."""
    name, g = _op(op), _group(group)
    if g is None:
        return None
    return _finish(comm.all_reduce_async(tensor, g, name), async_op)


def all_gather(
    tensor_list: list[torch.Tensor],
    tensor: torch.Tensor,
    group: Any = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "all_gather",
    debug: str | None = None,
) -> Work | None:
    """Every member's ``tensor`` into ``tensor_list`` (one tensor per member, group order)."""
    g = _group(group)
    if g is None:
        return None
    if len(tensor_list) != g.size:
        raise DistributedError(
            f"all_gather into a list of {len(tensor_list)} tensors over a group of {g.size}",
            where="deepspeed.comm.all_gather",
            fix="pass one output tensor per group member",
        )

    def then(gathered: torch.Tensor) -> None:
        for dst, part in zip(tensor_list, gathered.chunk(g.size), strict=True):
            if part is not dst:
                dst.copy_(part.reshape(dst.shape))

    return _finish(comm.all_gather_async(tensor, g), async_op, then)


def all_gather_into_tensor(
    output_tensor: torch.Tensor,
    tensor: torch.Tensor,
    group: Any = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "all_gather_into_tensor",
    debug: str | None = None,
) -> Work | None:
    """Every member's ``tensor`` concatenated (or stacked) into ``output_tensor``."""
    g = _group(group)
    if g is None:
        return None
    return _finish(comm.all_gather_async(tensor, g), async_op, _copy_into(output_tensor))


def allgather_fn(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: Any = None,
    async_op: bool = False,
    debug: str | None = None,
) -> Work | None:
    """DeepSpeed's helper: :func:`all_gather_into_tensor`."""
    return all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter_tensor(
    output_tensor: torch.Tensor,
    tensor: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "reduce_scatter_tensor",
    debug: str | None = None,
) -> Work | None:
    """Reduce ``tensor`` over ``group``; this member's chunk (along dim 0) into
    ``output_tensor``."""
    name, g = _op(op), _group(group)
    if g is None:
        return None
    pending = comm.reduce_scatter_async(tensor, g, dim=0, op=name)
    return _finish(pending, async_op, _copy_into(output_tensor))


def reduce_scatter_fn(
    output_tensor: torch.Tensor,
    tensor: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
    prof: bool = False,
    debug: str | None = None,
) -> Work | None:
    """DeepSpeed's helper: :func:`reduce_scatter_tensor`."""
    return reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def broadcast(
    tensor: torch.Tensor,
    src: int,
    group: Any = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "broadcast",
    debug: str | None = None,
) -> Work | None:
    """Global rank ``src``'s ``tensor`` into every member's ``tensor``."""
    g = _group(group)
    if g is None:
        return None
    return _finish(comm.broadcast_async(tensor, g, member_index(g, src, "broadcast")), async_op)


def all_to_all_single(
    output: torch.Tensor,
    tensor: torch.Tensor,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    group: Any = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "all_to_all_single",
    debug: str | None = None,
) -> Work | None:
    """Slice j of ``tensor`` (dim 0) to member j; member j's slice for this rank into slice j of
    ``output`` (equal slices unless the split sizes are given)."""
    g = _group(group)
    if g is None:
        return None
    pending = comm.all_to_all_async(tensor, g, output, input_split_sizes, output_split_sizes)
    return _finish(pending, async_op)


def barrier(
    group: Any = None,
    async_op: bool = False,
    device_ids: Any = None,
    prof: bool = False,
    log_name: str = "barrier",
    debug: str | None = None,
) -> Work | None:
    """Wait until every member of ``group`` (default: the world) gets here."""
    g = _group(group)
    if g is None:
        return None
    comm.barrier(g)
    return Work(Pending.done(torch.empty(0))) if async_op else None


# --------------------------------------------------------------------------------------------
# Point to point (global ranks)


def _p2p(peer: int | None, group: Any, what: str) -> Group:
    """The group a point-to-point transfer goes over (comm checks both ends are in it)."""
    if peer is None:
        raise DistributedError(
            f"{what} from any source is not supported",
            where=f"deepspeed.comm.{what}",
            fix="pass src, the global rank of the sender",
        )
    return group_of(group) if is_initialized() else Group.single("world")


def send(
    tensor: torch.Tensor,
    dst: int,
    group: Any = None,
    tag: int = 0,
    prof: bool = False,
    log_name: str = "send",
    debug: str | None = None,
) -> None:
    """Send ``tensor`` to global rank ``dst`` (blocking)."""
    comm.send(tensor, dst, tag=tag, group=_p2p(dst, group, "send"))


def recv(
    tensor: torch.Tensor,
    src: int | None = None,
    group: Any = None,
    tag: int = 0,
    prof: bool = False,
    log_name: str = "recv",
    debug: str | None = None,
) -> int:
    """Receive into ``tensor`` from global rank ``src`` (blocking); return ``src``."""
    comm.recv(tensor, src, tag=tag, group=_p2p(src, group, "recv"))
    return src  # type: ignore[return-value]  # _p2p refused None


def isend(
    tensor: torch.Tensor,
    dst: int,
    group: Any = None,
    tag: int = 0,
    prof: bool = False,
    log_name: str = "isend",
    debug: str | None = None,
) -> Work:
    """Start sending ``tensor`` to global rank ``dst``; ``wait()`` on the result."""
    return Work(comm.isend(tensor, dst, tag=tag, group=_p2p(dst, group, "isend")))


def irecv(
    tensor: torch.Tensor,
    src: int | None = None,
    group: Any = None,
    tag: int = 0,
    prof: bool = False,
    log_name: str = "irecv",
    debug: str | None = None,
) -> Work:
    """Start receiving into ``tensor`` from global rank ``src``; ``wait()`` on the result."""
    return Work(comm.irecv(tensor, src, tag=tag, group=_p2p(src, group, "irecv")))
