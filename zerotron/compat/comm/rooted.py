"""``deepspeed.comm``'s rooted collectives and barriers: :func:`reduce`, :func:`gather`,
:func:`scatter`, :func:`monitored_barrier`, :func:`inference_all_reduce`.

Arguments and results are DeepSpeed's (which are torch.distributed's): ``dst`` and ``src`` are
global ranks, ``group=None`` is the world, ``async_op=True`` returns a
:class:`~zerotron.compat.comm.comm.Work`. The transfers go through
:mod:`zerotron.distributed.comm`, so the ledger records them (``reduce``, ``gather``,
``scatter``).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

from zerotron.compat.comm.comm import (
    Work,
    _copy_into,
    _finish,
    _group,
    _op,
    all_reduce,
    barrier,
    member_index,
)
from zerotron.compat.comm.reduce_op import ReduceOp
from zerotron.distributed import comm
from zerotron.errors import DistributedError


def reduce(
    tensor: torch.Tensor,
    dst: int,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "reduce",
    debug: str | None = None,
) -> Work | None:
    """Reduce ``tensor`` over ``group`` into global rank ``dst``'s ``tensor`` (the other
    members' ``tensor`` is left unspecified, as in torch)."""
    name, g = _op(op), _group(group)
    if g is None:
        return None
    return _finish(comm.reduce_async(tensor, g, member_index(g, dst, "reduce"), name), async_op)


def gather(
    tensor: torch.Tensor,
    gather_list: list[torch.Tensor] | None = None,
    dst: int = 0,
    group: Any = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "gather",
    debug: str | None = None,
) -> Work | None:
    """Every member's ``tensor`` into global rank ``dst``'s ``gather_list`` (one tensor per
    member, group order); the other members pass no list."""
    g = _group(group)
    if g is None:
        return None
    root = member_index(g, dst, "gather")
    if g.rank == root and (gather_list is None or len(gather_list) != g.size):
        raise DistributedError(
            f"gather on rank {dst} into {'no list' if gather_list is None else len(gather_list)}"
            f" for a group of {g.size}",
            where="deepspeed.comm.gather",
            fix="the destination passes gather_list, one tensor per group member",
        )

    def then(stacked: torch.Tensor) -> None:
        if g.rank == root and gather_list is not None:
            for out, part in zip(gather_list, stacked.unbind(0), strict=True):
                out.copy_(part.reshape(out.shape))

    return _finish(comm.gather_async(tensor, g, root), async_op, then)


def scatter(
    tensor: torch.Tensor,
    scatter_list: list[torch.Tensor] | None = None,
    src: int = 0,
    group: Any = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "scatter",
    debug: str | None = None,
) -> Work | None:
    """Global rank ``src``'s ``scatter_list`` (one tensor per member, group order) into every
    member's ``tensor``; the other members pass no list."""
    g = _group(group)
    if g is None:
        return None
    pending = comm.scatter_async(tensor, g, scatter_list, member_index(g, src, "scatter"))
    return _finish(pending, async_op, _copy_into(tensor))


def monitored_barrier(
    group: Any = None,
    timeout: timedelta | None = None,
    wait_all_ranks: bool = False,
    prof: bool = False,
    log_name: str = "monitored_barrier",
    debug: str | None = None,
) -> None:
    """A barrier that names the ranks that did not arrive: every zerotron barrier does (the
    collective watchdog), within the job's timeout; ``timeout`` and ``wait_all_ranks`` are
    accepted."""
    barrier(group)


def inference_all_reduce(
    tensor: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "all_reduce",
    debug: str | None = None,
) -> None:
    """:func:`~zerotron.compat.comm.comm.all_reduce`, blocking (DeepSpeed's shared-memory
    inference path falls back to the same all-reduce)."""
    all_reduce(tensor, op, group)
