"""``deepspeed.comm``'s list and batch forms: :func:`all_to_all`, :func:`reduce_scatter`,
:func:`all_reduce_coalesced`, :func:`all_gather_coalesced`, :class:`P2POp` and
:func:`batch_isend_irecv`.

Each packs its list into one flat tensor and makes the single-tensor call of
:mod:`zerotron.distributed.comm` (so the ledger records one ``all_to_all``, one
``reduce_scatter``, one ``all_reduce``), then copies the result back into the caller's tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from zerotron.compat.comm.comm import (
    Work,
    _finish,
    _group,
    _op,
    all_gather_into_tensor,
    irecv,
    isend,
)
from zerotron.compat.comm.reduce_op import ReduceOp
from zerotron.distributed import comm
from zerotron.distributed.comm import Pending
from zerotron.distributed.state import group_of
from zerotron.errors import DistributedError


def _flat(tensors: Sequence[torch.Tensor], what: str) -> torch.Tensor:
    """``tensors`` flattened into one tensor; they must share a dtype and a device."""
    kinds = {(t.dtype, t.device) for t in tensors}
    if len(kinds) > 1:
        raise DistributedError(
            f"{what} of tensors of several dtypes or devices: {sorted(map(str, kinds))}",
            where=f"deepspeed.comm.{what}",
            fix="pass tensors of one dtype on one device (one call per dtype)",
        )
    return torch.cat([t.reshape(-1) for t in tensors])


def _scatter_back(dsts: Sequence[torch.Tensor]) -> Callable[[torch.Tensor], None]:
    """Copy a flat result into ``dsts``, in order."""

    def then(flat: torch.Tensor) -> None:
        for dst, part in zip(dsts, flat.split([t.numel() for t in dsts]), strict=True):
            dst.copy_(part.reshape(dst.shape))

    return then


def all_to_all(
    output_tensor_list: list[torch.Tensor],
    input_tensor_list: list[torch.Tensor],
    group: Any = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "all_to_all",
    debug: str | None = None,
) -> Work | None:
    """``input_tensor_list[j]`` to member j; member j's tensor for this rank into
    ``output_tensor_list[j]`` (sizes may differ per member)."""
    g = _group(group)
    if g is None:
        return None
    for lst, name in ((output_tensor_list, "output"), (input_tensor_list, "input")):
        if len(lst) != g.size:
            raise DistributedError(
                f"all_to_all with {len(lst)} {name} tensors over a group of {g.size}",
                where="deepspeed.comm.all_to_all",
                fix="pass one input and one output tensor per group member",
            )
    flat_in = _flat(input_tensor_list, "all_to_all")
    out = torch.empty(
        sum(t.numel() for t in output_tensor_list), dtype=flat_in.dtype, device=flat_in.device
    )
    pending = comm.all_to_all_async(
        flat_in,
        g,
        out,
        [t.numel() for t in input_tensor_list],
        [t.numel() for t in output_tensor_list],
    )
    return _finish(pending, async_op, _scatter_back(output_tensor_list))


def reduce_scatter(
    output: torch.Tensor,
    input_list: list[torch.Tensor],
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "reduce_scatter",
    debug: str | None = None,
) -> Work | None:
    """Reduce ``input_list`` (one tensor per member, each of ``output``'s size) over the group;
    this member's reduced tensor into ``output``."""
    name, g = _op(op), _group(group)
    if g is None:
        return None
    if len(input_list) != g.size or any(t.numel() != output.numel() for t in input_list):
        raise DistributedError(
            f"reduce_scatter of {len(input_list)} tensors of sizes "
            f"{[t.numel() for t in input_list]} into {output.numel()} elements over a group "
            f"of {g.size}",
            where="deepspeed.comm.reduce_scatter",
            fix="pass one input per group member, each with as many elements as the output",
        )
    pending = comm.reduce_scatter_async(_flat(input_list, "reduce_scatter"), g, op=name)
    return _finish(pending, async_op, _scatter_back([output]))


def all_reduce_coalesced(
    tensors: list[torch.Tensor],
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "all_reduce",
    debug: str | None = None,
) -> Work | None:
    """Reduce every tensor of ``tensors`` in place with one all-reduce (one dtype, one
    device)."""
    name, g = _op(op), _group(group)
    if g is None or not tensors:
        return None
    flat = _flat(tensors, "all_reduce_coalesced")
    return _finish(comm.all_reduce_async(flat, g, name), async_op, _scatter_back(tensors))


class _AllOf(Work):
    """Several handles waited for as one."""

    def __init__(self, works: list[Work]):
        super().__init__(Pending.done(torch.empty(0)))
        self._works = works

    def wait(self, timeout: Any = None) -> bool:
        for work in self._works:
            work.wait()
        self._done = True
        return True


def all_gather_coalesced(
    output_tensors: list[torch.Tensor],
    input_tensors: list[torch.Tensor],
    group: Any = None,
    async_op: bool = False,
) -> Work | None:
    """:func:`~zerotron.compat.comm.comm.all_gather_into_tensor` of each input into the output
    at the same position, started together."""
    if len(output_tensors) != len(input_tensors):
        raise DistributedError(
            f"all_gather_coalesced of {len(input_tensors)} inputs into {len(output_tensors)} "
            "outputs",
            where="deepspeed.comm.all_gather_coalesced",
            fix="pass one output per input",
        )
    works = [
        all_gather_into_tensor(out, inp, group=group, async_op=True)
        for out, inp in zip(output_tensors, input_tensors, strict=True)
    ]
    joined = _AllOf([w for w in works if w is not None])
    if async_op:
        return joined
    joined.wait()
    return None


def has_all_reduce_coalesced() -> bool:
    """True: :func:`all_reduce_coalesced` works on every backend."""
    return True


def has_coalescing_manager() -> bool:
    """False: zerotron has no coalescing manager (DeepSpeed's callers then issue one call per
    tensor)."""
    return False


class P2POp:
    """One send or receive for :func:`batch_isend_irecv` (DeepSpeed's and torch's ``P2POp``).

    Args:
        op: ``deepspeed.comm.isend`` or ``irecv`` (torch's are accepted too).
        tensor: what is sent, or where it is received.
        peer: the other end's global rank.
        group: the group both ends are in (default: the world).
        tag: must be 0: zerotron matches a batch's messages by order.
    """

    def __init__(self, op: Any, tensor: torch.Tensor, peer: int, group: Any = None, tag: int = 0):
        kind = getattr(op, "__name__", None)
        if op not in (isend, irecv) and kind not in ("isend", "irecv"):
            raise DistributedError(
                f"P2POp with op {op!r}",
                where="deepspeed.comm.P2POp",
                fix="op is deepspeed.comm.isend or deepspeed.comm.irecv",
            )
        if tag != 0:
            raise DistributedError(
                f"P2POp with tag {tag}",
                where="deepspeed.comm.P2POp",
                fix="leave tag at 0: a batch's messages between two ranks match in order",
            )
        self.op = "isend" if kind == "isend" else "irecv"
        self.tensor = tensor
        self.peer = peer
        self.group = group
        self.tag = tag


def batch_isend_irecv(
    p2p_op_list: list[P2POp],
    prof: bool = False,
    log_name: str = "batch_isend_irecv",
    debug: str | None = None,
) -> list[Work]:
    """Post every send and receive of ``p2p_op_list`` together and finish them; one completed
    handle per operation comes back (``wait()`` on it returns at once)."""
    if not p2p_op_list:
        return []
    groups = {id(o.group) for o in p2p_op_list}
    if len(groups) > 1:
        raise DistributedError(
            "batch_isend_irecv over several groups",
            where="deepspeed.comm.batch_isend_irecv",
            fix="one batch per group",
        )
    name = group_of(p2p_op_list[0].group).name
    ops = [comm.P2P("send" if o.op == "isend" else "recv", o.tensor, o.peer) for o in p2p_op_list]
    comm.batch_isend_irecv(ops, group_name=name)
    return [Work(Pending.done(o.tensor)) for o in p2p_op_list]
