"""Every collective and point-to-point call of zerotron, with a ledger of the bytes it moves.

This is the one module that calls ``torch.distributed`` communication functions. Each call takes
a :class:`Group` (built by :mod:`zerotron.distributed.state`), returns immediately when the group
has one rank (no torch call, nothing recorded), and otherwise records ``(group, op, bytes)`` in
the module-level :data:`ledger` before it communicates. Tests assert exact traffic with
``ledger.capture()``; benchmarks compare the totals with closed-form theory.

Ledger conventions (bytes are ``numel * element_size`` of a tensor the caller passes):

==================  ====================  ==============================================
op                  group                 bytes recorded (per call, on this rank)
==================  ====================  ==============================================
``all_reduce``      the group's name      the tensor reduced
``all_gather``      the group's name      this rank's input shard (output = size × that)
``reduce_scatter``  the group's name      the full input (output = that / size)
``broadcast``       the group's name      the tensor broadcast (same on every rank)
``all_to_all``      the group's name      this rank's input (what it scatters)
``reduce``          the group's name      the tensor reduced (the result lands on one rank)
``gather``          the group's name      this rank's input (the root receives size × that)
``scatter``         the group's name      this rank's output (the root sends size × that)
``barrier``         the group's name      0
``send``/``recv``   ``group_name`` arg    the tensor sent / received; default ``"pp"``
                    (or ``group``'s)      (``isend``/``irecv`` too)
==================  ====================  ==============================================

The ledger records the *logical* operation, not how a backend carried it out: ``avg`` is a sum
followed by a division on every backend, and where a backend lacks a fused all-gather or
reduce-scatter the fallback (list all-gather; all-reduce then slice) still records one
``all_gather`` of the shard or one ``reduce_scatter`` of the full input. These are the sizes
the parallel algorithms are written in (Megatron's "4 all-reduces of b·s·h per layer"), so
theory and measurement compare directly. What a ring algorithm puts on the wire per rank is a
fixed factor away: 2(n-1)/n × the recorded bytes for all-reduce, (n-1)/n for reduce-scatter,
(n-1) for all-gather (n = group size).

Asynchronous variants (``*_async``) return a :class:`Pending` whose ``wait()`` gives the result;
they let data-parallel gradient buckets overlap with backward. ``batch_isend_irecv(...,
wait_sends=False)`` waits for its receives only and returns one :class:`Pending` per send,
so a pipeline stage computes while its sends drain.

On gloo (CPU tensors), all-gather and reduce-scatter are exchanges of point-to-point messages
(:func:`_exchange`): an all-gather posts every send and receive at once, a reduce-scatter is
one exchange between two members and a ring of n - 1 exchanges between more, and the reduction
is torch's own add: gloo's fused reduce-scatter and all-gather took 3-4x as long for the same
bytes (2 ranks, 46 MB of bf16, quiet machine: 75 and 53 ms against 19 and 18 ms; see
``bench/README.md``, zero section). Each rank sends and receives (n-1)/n of the tensor, what a
ring moves; the ledger records the same logical operation.

Every call is bounded by the job's timeout (the groups carry it), is counted per group for
:mod:`~zerotron.distributed.liveness`, and its blocking wait is marked for the collective
:mod:`~zerotron.distributed.watchdog`; a torch error in its start or wait becomes a
:class:`DistributedError` naming the op, the group and the stuck rank or the peer that left
(:mod:`~zerotron.distributed.failures`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from zerotron.distributed import liveness, watchdog
from zerotron.distributed.failures import Call, key
from zerotron.distributed.group import Group as Group  # re-exported: comm.Group
from zerotron.distributed.group import world_group as world_group  # re-exported
from zerotron.distributed.ledger import Ledger as Ledger  # re-exported: comm.Ledger
from zerotron.distributed.ledger import ledger
from zerotron.errors import DistributedError

REDUCE_OPS = ("sum", "avg", "max", "min", "product", "band", "bor", "bxor")

# torch >= 2.13 names the fused single-tensor collectives *_single; older ones *_tensor.
_ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or getattr(
    dist, "all_gather_into_tensor", None
)
_REDUCE_SCATTER_SINGLE = getattr(dist, "reduce_scatter_single", None) or getattr(
    dist, "reduce_scatter_tensor", None
)


def _active(group: Group, op: str) -> bool:
    """True when ``op`` must communicate; raise when this rank cannot take part."""
    if group.size == 1 and group.is_member:
        return False
    if not group.is_member:
        raise DistributedError(
            f"{op} on the {group.name} group {list(group.ranks)}, which this rank is not in",
            where=f"comm.{op}",
            fix=f"call {op} only on ranks of the group (see ParallelState.{group.name})",
        )
    if group.pg is None:
        raise DistributedError(
            f"the {group.name} group {list(group.ranks)} has no process group",
            where=f"comm.{op}",
            fix="call init_distributed() and initialize_model_parallel() first",
        )
    return True


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _record(group: Group, op: str, nbytes: int) -> Call:
    """Record a collective in the ledger and count it on the group (for naming a stuck rank)."""
    ledger.record(group.name, op, nbytes)
    return Call(group, op, liveness.count(key(group)), nbytes=nbytes)


# --------------------------------------------------------------------------------------------
# Pending results


class Pending:
    """A collective in flight; :meth:`wait` blocks until it is done and returns its result."""

    def __init__(
        self, work: Any, finish: Callable[[], torch.Tensor], call: Call | None = None
    ) -> None:
        self._work = work
        self._finish: Callable[[], torch.Tensor] | None = finish
        self._result: torch.Tensor | None = None
        self._call = call

    @classmethod
    def done(cls, result: torch.Tensor) -> Pending:
        return cls(None, lambda: result)

    def wait(self) -> torch.Tensor:
        guard = self._call.guard() if self._call is not None else nullcontext()
        waiting = watchdog.enter(self._call) if self._call is not None else None
        try:
            with guard:
                if self._work is not None:
                    self._work.wait()
                    self._work = None
                if self._finish is not None:
                    self._result = self._finish()
                    self._finish = None
        finally:
            if waiting is not None:
                watchdog.leave(waiting)
        assert self._result is not None
        return self._result


def _back_into(t: torch.Tensor, buf: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A ``finish`` that returns ``t``, first copying the result in from ``buf`` (the
    contiguous copy a collective ran on) when that is another tensor."""

    def finish() -> torch.Tensor:
        if buf is not t:
            t.copy_(buf)
        return t

    return finish


def _torch_op(op: str) -> Any:
    if op not in REDUCE_OPS:
        raise DistributedError(f"unknown reduce op {op!r}", fix=f"use one of {REDUCE_OPS}")
    # avg is a sum and a division everywhere: the same numerics on gloo and nccl.
    return {
        "sum": dist.ReduceOp.SUM,
        "avg": dist.ReduceOp.SUM,
        "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN,
        "product": dist.ReduceOp.PRODUCT,
        "band": dist.ReduceOp.BAND,
        "bor": dist.ReduceOp.BOR,
        "bxor": dist.ReduceOp.BXOR,
    }[op]


def _fused(fn: Callable[..., Any] | None, *args: Any, **kwargs: Any) -> Any:
    """Start the fused collective ``fn``; None when torch or the backend does not have it.

    Only a refusal ("not supported", raised before any byte moves, on every rank alike) falls
    back; a real failure such as a timeout propagates.
    """
    if fn is None:
        return None
    try:
        return fn(*args, async_op=True, **kwargs)
    except NotImplementedError:
        return None
    except RuntimeError as err:
        text = str(err).lower()
        if "not support" in text or "unsupported" in text:
            return None
        raise


# --------------------------------------------------------------------------------------------
# Pairwise exchanges (gloo)

pairwise_on_gloo = True
"""Set False to use gloo's own fused all-gather and reduce-scatter instead of exchanges."""
_P2P_TAG_BASE = 1 << 20  # above the pipeline's point-to-point messages (tag 0)
# Keyed by the ProcessGroup itself, weakly: a new group may reuse a destroyed one's id().
_p2p_calls: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
_backends: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def _pairwise(t: torch.Tensor, group: Group) -> bool:
    """Whether ``group``'s collectives on ``t`` go through :func:`_exchange` (gloo, CPU)."""
    if not pairwise_on_gloo or t.device.type != "cpu":
        return False
    if group.pg not in _backends:
        _backends[group.pg] = str(dist.get_backend(group.pg))
    return "gloo" in _backends[group.pg]


def _cuda_only(t: torch.Tensor, group: Group) -> bool:
    """Whether ``t`` is a CPU tensor and ``group``'s backend takes CUDA tensors only (nccl)."""
    if t.device.type != "cpu":
        return False
    if group.pg not in _backends:
        _backends[group.pg] = str(dist.get_backend(group.pg))
    return not any(b in _backends[group.pg] for b in ("gloo", "mpi"))


class _Works:
    """Several point-to-point works waited for as one."""

    def __init__(self, works: list[Any]):
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()


def _reserve_tags(group: Group, count: int = 1) -> int:
    """The first of ``count`` message tags for one collective on ``group``.

    Every member calls the group's collectives in the same order, so a per-group count of
    them gives both ends of each message the same tag, apart from other calls still in flight.
    """
    first = _p2p_calls.get(group.pg, 0)
    _p2p_calls[group.pg] = first + count
    return _P2P_TAG_BASE + first % (1 << 30)


def _exchange(
    group: Group,
    sends: dict[int, torch.Tensor],
    recvs: dict[int, torch.Tensor],
    tag: int | None = None,
) -> _Works:
    """Post every send and receive of one collective at once (keys: member indices)."""
    tag = _reserve_tags(group) if tag is None else tag
    ops = [dist.P2POp(dist.isend, t, group.ranks[j], group.pg, tag) for j, t in sends.items()] + [
        dist.P2POp(dist.irecv, t, group.ranks[j], group.pg, tag) for j, t in recvs.items()
    ]
    return _Works(dist.batch_isend_irecv(ops))


# --------------------------------------------------------------------------------------------
# Collectives


def all_reduce_async(t: torch.Tensor, group: Group, op: str = "sum") -> Pending:
    """Start reducing ``t`` in place over ``group``; ``wait()`` returns ``t``."""
    torch_op = _torch_op(op)
    if not _active(group, "all_reduce"):
        return Pending.done(t)
    call = _record(group, "all_reduce", _nbytes(t))
    buf = t if t.is_contiguous() else t.contiguous()
    if _cuda_only(t, group):
        # A CPU tensor (an overflow flag, a norm, a count) on a group whose backend carries only
        # CUDA tensors (nccl) travels through the current GPU; ``finish`` copies it back.
        buf = t.to(torch.device("cuda", torch.cuda.current_device()))
    with call.guard():
        work = dist.all_reduce(buf, op=torch_op, group=group.pg, async_op=True)

    def finish() -> torch.Tensor:
        if op == "avg":
            buf.div_(group.size)
        if buf is not t:
            t.copy_(buf)
        return t

    return Pending(work, finish, call)


def all_reduce(t: torch.Tensor, group: Group, op: str = "sum") -> torch.Tensor:
    """Reduce ``t`` in place over ``group`` (``sum``, ``avg``, ``max``, ``min``); return ``t``."""
    return all_reduce_async(t, group, op).wait()


def all_gather_async(t: torch.Tensor, group: Group, dim: int = 0) -> Pending:
    """Start gathering every rank's ``t``; ``wait()`` returns them concatenated along ``dim``."""
    if not _active(group, "all_gather"):
        return Pending.done(t if t.dim() else t.reshape(1))
    shard = t.contiguous() if t.dim() else t.reshape(1)  # scalars gather into a vector
    dim = _check_dim(shard, dim, "all_gather")
    call = _record(group, "all_gather", _nbytes(t))
    n = group.size
    # Shards land one after another along dim 0 (the layout every backend's fused op takes).
    gathered = torch.empty(
        (n * shard.shape[0], *shard.shape[1:]), dtype=shard.dtype, device=shard.device
    )
    parts = list(gathered.chunk(n))
    with call.guard():
        work = _start_all_gather(group, shard, gathered, parts)

    def finish() -> torch.Tensor:
        return gathered if dim == 0 else torch.cat(gathered.chunk(n), dim=dim)

    return Pending(work, finish, call)


def _start_all_gather(
    group: Group, shard: torch.Tensor, gathered: torch.Tensor, parts: list[torch.Tensor]
) -> Any:
    n = group.size
    if _pairwise(shard, group):
        me = group.rank
        parts[me].copy_(shard)
        others = [j for j in range(n) if j != me]
        work = _exchange(group, {j: shard for j in others}, {j: parts[j] for j in others})
    else:
        work = _fused(_ALL_GATHER_SINGLE, gathered, shard, group=group.pg)
    if work is None:  # the backend has no fused all-gather: gather into a list of views
        work = dist.all_gather(parts, shard, group=group.pg, async_op=True)
    return work


def all_gather(t: torch.Tensor, group: Group, dim: int = 0) -> torch.Tensor:
    """Every rank's ``t`` concatenated along ``dim``, in group order.

    At size 1 that is ``t`` itself (no copy); a 0-d ``t`` gathers into a vector of group size.
    """
    return all_gather_async(t, group, dim).wait()


def reduce_scatter_async(t: torch.Tensor, group: Group, dim: int = 0, op: str = "sum") -> Pending:
    """Start reducing ``t`` over ``group``; ``wait()`` returns this rank's chunk along ``dim``."""
    torch_op = _torch_op(op)
    if not _active(group, "reduce_scatter"):
        return Pending.done(t)
    dim = _check_dim(t, dim, "reduce_scatter")
    n = group.size
    if t.shape[dim] % n:
        raise DistributedError(
            f"reduce_scatter of a tensor of shape {tuple(t.shape)}: dim {dim} ({t.shape[dim]}) "
            f"is not divisible by the {group.name} group size {n}",
            where="comm.reduce_scatter",
            fix=f"pad dim {dim} to a multiple of {n}",
        )
    call = _record(group, "reduce_scatter", _nbytes(t))
    # The fused op scatters chunks of dim 0: bring the chunks of ``dim`` there first.
    full = t.contiguous() if dim == 0 else torch.cat(t.chunk(n, dim=dim))
    if _pairwise(full, group) and op in ("sum", "avg"):
        with call.guard():
            return _pairwise_reduce_scatter(full, group, op, call)
    out = torch.empty((full.shape[0] // n, *full.shape[1:]), dtype=t.dtype, device=t.device)
    with call.guard():
        work = _fused(_REDUCE_SCATTER_SINGLE, out, full, op=torch_op, group=group.pg)
    result = out
    if work is None:
        # No fused reduce-scatter in this backend: everyone reduces everything and keeps its
        # chunk (twice the traffic; the ledger still records the logical reduce_scatter).
        reduced = full.clone()
        with call.guard():
            work = dist.all_reduce(reduced, op=torch_op, group=group.pg, async_op=True)
        result = reduced.chunk(n)[group.rank]

    def finish() -> torch.Tensor:
        return result.div_(n) if op == "avg" else result

    return Pending(work, finish, call)


def _pairwise_reduce_scatter(full: torch.Tensor, group: Group, op: str, call: Call) -> Pending:
    """Two members: each sends the other's chunk of ``full`` and adds what it receives to its
    own (``a + b``: the same bits either way round). More: a ring (:func:`_ring_steps`)."""
    n, me = group.size, group.rank
    chunks = full.chunk(n)
    if n > 2:
        return _ring_steps(chunks, group, op, call)
    received = torch.empty_like(chunks[0])
    work = _exchange(group, {1 - me: chunks[1 - me]}, {1 - me: received})

    def finish() -> torch.Tensor:
        out = received.add_(chunks[me])
        return out.div_(n) if op == "avg" else out

    return Pending(work, finish, call)


def _ring_steps(chunks: tuple[torch.Tensor, ...], group: Group, op: str, call: Call) -> Pending:
    """Reduce-scatter over n > 2 members in n - 1 ring steps, two chunks of memory (posting
    every pairwise message at once would need n - 1). Step k receives from the previous member
    the partial sum of chunk ``me - k - 2`` (mod n), adds this member's own part of it and
    passes it on; after the last step it is the sum of chunk ``me``. The first step is posted
    now, the others run in ``wait()``."""
    n, me = group.size, group.rank
    nxt, prv = (me + 1) % n, (me - 1) % n
    tags = _reserve_tags(group, n - 1)
    bufs = (torch.empty_like(chunks[0]), torch.empty_like(chunks[0]))
    first = _exchange(group, {nxt: chunks[(me - 1) % n]}, {prv: bufs[0]}, tags)

    def finish() -> torch.Tensor:
        work = first
        for k in range(n - 1):
            work.wait()
            acc = bufs[k % 2].add_(chunks[(me - k - 2) % n])
            if k < n - 2:
                work = _exchange(group, {nxt: acc}, {prv: bufs[(k + 1) % 2]}, tags + k + 1)
        return acc.div_(n) if op == "avg" else acc

    return Pending(None, finish, call)


def reduce_scatter(t: torch.Tensor, group: Group, dim: int = 0, op: str = "sum") -> torch.Tensor:
    """Reduce ``t`` over ``group`` and return chunk ``group.rank`` of the result along ``dim``.

    ``t.shape[dim]`` must be divisible by the group size. At size 1, ``t`` itself.
    """
    return reduce_scatter_async(t, group, dim, op).wait()


def broadcast_async(t: torch.Tensor, group: Group, src_rank_in_group: int = 0) -> Pending:
    """Start copying member ``src_rank_in_group``'s ``t`` into every member's ``t``;
    ``wait()`` returns ``t``."""
    if not _active(group, "broadcast"):
        return Pending.done(t)
    if not 0 <= src_rank_in_group < group.size:
        raise DistributedError(
            f"broadcast source {src_rank_in_group} is outside the {group.name} group of size "
            f"{group.size}",
            where="comm.broadcast",
        )
    call = _record(group, "broadcast", _nbytes(t))
    buf = t if t.is_contiguous() else t.contiguous()
    with call.guard():
        work = dist.broadcast(
            buf, src=group.ranks[src_rank_in_group], group=group.pg, async_op=True
        )
    return Pending(work, _back_into(t, buf), call)


def broadcast(t: torch.Tensor, group: Group, src_rank_in_group: int = 0) -> torch.Tensor:
    """Copy the group member ``src_rank_in_group``'s ``t`` into every member's ``t``."""
    return broadcast_async(t, group, src_rank_in_group).wait()


def broadcast_text(
    text: str | None, group: Group, device: torch.device | str = "cpu"
) -> str | None:
    """The group's first member's ``text`` on every member (None stays None): its UTF-8 length,
    then its bytes, broadcast as tensors on ``device`` (the group's backend's device). Other
    members' ``text`` is ignored. At size 1, ``text`` itself."""
    if group.size == 1:
        return text
    data = b"" if text is None else text.encode("utf-8")
    length = torch.tensor([-1 if text is None else len(data)], device=device)
    broadcast(length, group)
    n = int(length)
    if n <= 0:
        return None if n < 0 else ""
    source = group.rank == 0
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if source else None
    buf = (buf if buf is not None else torch.empty(n, dtype=torch.uint8)).to(device)
    broadcast(buf, group)
    return bytes(buf.cpu().tolist()).decode("utf-8")


def all_to_all_async(
    t: torch.Tensor,
    group: Group,
    out: torch.Tensor | None = None,
    in_splits: Sequence[int] | None = None,
    out_splits: Sequence[int] | None = None,
) -> Pending:
    """Start an all-to-all: member j gets this rank's ``j``-th slice of ``t`` along dim 0 and
    this rank's ``j``-th slice of ``out`` is member j's; ``wait()`` returns ``out``.

    Slices are equal (dim 0 divisible by the group size) unless ``in_splits`` / ``out_splits``
    give their lengths. ``out`` defaults to a new tensor shaped like ``t`` (equal slices). At
    size 1, ``t`` itself (copied into ``out`` when one is given).
    """
    if not _active(group, "all_to_all"):
        return Pending.done(t if out is None else out.copy_(t))
    n = group.size
    for splits, what in ((in_splits, t), (out_splits, out)):
        if splits is None and what is not None and what.dim() and what.shape[0] % n:
            raise DistributedError(
                f"all_to_all of a tensor of shape {tuple(what.shape)}: dim 0 is not divisible "
                f"by the {group.name} group size {n}",
                where="comm.all_to_all",
                fix="pass split sizes, or pad dim 0 to a multiple of the group size",
            )
    if out is None:
        out = torch.empty_like(t, memory_format=torch.contiguous_format)
    call = _record(group, "all_to_all", _nbytes(t))
    src = t.contiguous()
    dst = (
        out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
    )
    in_list = None if in_splits is None else list(in_splits)
    out_list = None if out_splits is None else list(out_splits)
    with call.guard():
        work = dist.all_to_all_single(dst, src, out_list, in_list, group=group.pg, async_op=True)

    def finish() -> torch.Tensor:
        if dst is not out:
            out.copy_(dst)
        return out

    return Pending(work, finish, call)


def all_to_all(
    t: torch.Tensor,
    group: Group,
    out: torch.Tensor | None = None,
    in_splits: Sequence[int] | None = None,
    out_splits: Sequence[int] | None = None,
) -> torch.Tensor:
    """The all-to-all of :func:`all_to_all_async`, waited for."""
    return all_to_all_async(t, group, out, in_splits, out_splits).wait()


def _check_root(group: Group, root: int, op: str) -> None:
    if not 0 <= root < group.size:
        raise DistributedError(
            f"{op} root {root} is outside the {group.name} group of size {group.size}",
            where=f"comm.{op}",
            fix="the root is a member's index in the group (0..size-1)",
        )


def reduce_async(
    t: torch.Tensor, group: Group, dst_rank_in_group: int = 0, op: str = "sum"
) -> Pending:
    """Start reducing ``t`` over ``group`` into member ``dst_rank_in_group``'s ``t``; ``wait()``
    returns ``t`` (on the other members its contents are unspecified, as torch's)."""
    torch_op = _torch_op(op)
    if not _active(group, "reduce"):
        return Pending.done(t)
    _check_root(group, dst_rank_in_group, "reduce")
    call = _record(group, "reduce", _nbytes(t))
    buf = t if t.is_contiguous() else t.contiguous()
    dst = group.ranks[dst_rank_in_group]
    with call.guard():
        work = dist.reduce(buf, dst=dst, op=torch_op, group=group.pg, async_op=True)

    def finish() -> torch.Tensor:
        if op == "avg" and group.rank == dst_rank_in_group:
            buf.div_(group.size)
        if buf is not t:
            t.copy_(buf)
        return t

    return Pending(work, finish, call)


def gather_async(t: torch.Tensor, group: Group, dst_rank_in_group: int = 0) -> Pending:
    """Start gathering every member's ``t`` on member ``dst_rank_in_group``; ``wait()`` returns
    them stacked along a new dim 0 there (group order) and ``t`` on the other members."""
    if not _active(group, "gather"):
        return Pending.done(t.unsqueeze(0))
    _check_root(group, dst_rank_in_group, "gather")
    call = _record(group, "gather", _nbytes(t))
    src = t.contiguous()
    root = group.rank == dst_rank_in_group
    out = None
    if root:
        out = torch.empty((group.size, *src.shape), dtype=src.dtype, device=src.device)
    with call.guard():
        work = dist.gather(
            src,
            list(out.unbind(0)) if out is not None else None,
            dst=group.ranks[dst_rank_in_group],
            group=group.pg,
            async_op=True,
        )
    return Pending(work, lambda: out if out is not None else t, call)


def scatter_async(
    t: torch.Tensor,
    group: Group,
    parts: Sequence[torch.Tensor] | None = None,
    src_rank_in_group: int = 0,
) -> Pending:
    """Start scattering ``parts`` (on member ``src_rank_in_group``: one tensor per member, in
    group order, each with ``t``'s elements) into every member's ``t``; ``wait()`` returns
    ``t``. Other members' ``parts`` are ignored."""
    _check_root(group, src_rank_in_group, "scatter")
    root = group.rank == src_rank_in_group
    if root and (parts is None or len(parts) != group.size):
        raise DistributedError(
            f"scatter from a root without one part per member of the {group.name} group "
            f"({group.size})",
            where="comm.scatter",
            fix="pass a list of group-size tensors on the root",
        )
    if not _active(group, "scatter"):
        t.copy_(parts[0].reshape(t.shape))  # type: ignore[index]  # the root: checked above
        return Pending.done(t)
    call = _record(group, "scatter", _nbytes(t))
    buf = t if t.is_contiguous() else t.contiguous()
    chunks = [c.reshape(t.shape).contiguous() for c in parts] if root and parts else None
    with call.guard():
        work = dist.scatter(
            buf, chunks, src=group.ranks[src_rank_in_group], group=group.pg, async_op=True
        )
    return Pending(work, _back_into(t, buf), call)


def barrier(group: Group | None = None) -> None:
    """Wait until every member of ``group`` (default: all ranks) gets here."""
    if group is None:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        group = world_group()
    if not _active(group, "barrier"):
        return
    call = _record(group, "barrier", 0)
    waiting = watchdog.enter(call)
    try:
        with call.guard():
            dist.barrier(group=group.pg)
    finally:
        watchdog.leave(waiting)


# --------------------------------------------------------------------------------------------
# Point to point (global ranks)


class P2P(NamedTuple):
    """One half of a point-to-point transfer for :func:`batch_isend_irecv`."""

    op: str  # "send" or "recv"
    tensor: torch.Tensor
    peer: int  # global rank


def _check_peer(t: torch.Tensor, peer: int, op: str, group: Group | None = None) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise DistributedError(
            f"{op} needs a process group", where=f"comm.{op}", fix="call init_distributed() first"
        )
    me, world = dist.get_rank(), dist.get_world_size()
    if not 0 <= peer < world or peer == me:
        raise DistributedError(
            f"{op} peer {peer} is not another rank of 0..{world - 1}", where=f"comm.{op}"
        )
    if group is not None and (peer not in group.ranks or not group.is_member):
        raise DistributedError(
            f"{op} between ranks {me} and {peer}, not both in the {group.name} group "
            f"{list(group.ranks)}",
            where=f"comm.{op}",
        )
    if not t.is_contiguous():
        raise DistributedError(f"{op} of a non-contiguous tensor", where=f"comm.{op}")


def _start_p2p(
    op: str, t: torch.Tensor, peer: int, group_name: str, tag: int, group: Group | None
) -> Pending:
    """Post one send or receive (``peer``: a global rank); ``wait()`` returns ``t``."""
    _check_peer(t, peer, op, group)
    ledger.record(group.name if group is not None else group_name, op, _nbytes(t))
    call = _p2p_call(op, [peer], _nbytes(t))
    pg = group.pg if group is not None else None
    start = dist.isend if op == "send" else dist.irecv
    with call.guard():
        work = start(t, peer, group=pg, tag=tag)
    return Pending(work, lambda: t, call)


def isend(
    t: torch.Tensor,
    dst_global_rank: int,
    group_name: str = "pp",
    tag: int = 0,
    group: Group | None = None,
) -> Pending:
    """Start sending ``t`` to global rank ``dst_global_rank``; ``wait()`` returns ``t``.

    Recorded under ``group_name``, or under ``group``'s name when the transfer goes over the
    torch process group of ``group`` (both ends must be members). Messages between the same
    two ranks are matched in order, per ``tag``.
    """
    return _start_p2p("send", t, dst_global_rank, group_name, tag, group)


def irecv(
    t: torch.Tensor,
    src_global_rank: int,
    group_name: str = "pp",
    tag: int = 0,
    group: Group | None = None,
) -> Pending:
    """Start receiving into ``t`` from global rank ``src_global_rank`` (see :func:`isend`)."""
    return _start_p2p("recv", t, src_global_rank, group_name, tag, group)


def send(
    t: torch.Tensor,
    dst_global_rank: int,
    group_name: str = "pp",
    tag: int = 0,
    group: Group | None = None,
) -> None:
    """Send ``t`` to global rank ``dst_global_rank`` (blocking); recorded under ``group_name``
    (or ``group``'s name, see :func:`isend`)."""
    isend(t, dst_global_rank, group_name, tag, group).wait()


def recv(
    t: torch.Tensor,
    src_global_rank: int,
    group_name: str = "pp",
    tag: int = 0,
    group: Group | None = None,
) -> torch.Tensor:
    """Receive into ``t`` from global rank ``src_global_rank`` (blocking); return ``t``."""
    return irecv(t, src_global_rank, group_name, tag, group).wait()


def batch_isend_irecv(
    ops: Sequence[P2P | tuple[str, torch.Tensor, int]],
    group_name: str = "pp",
    *,
    wait_sends: bool = True,
) -> list[Pending]:
    """Post all sends and receives of ``ops`` together; wait for the receives (and the sends).

    Posting both directions at once is what makes a pipeline's exchange of activations and
    gradients deadlock-free: no rank waits in a send for a peer that is itself sending.

    With ``wait_sends=False`` only the receives are waited for: the sends may still be in
    flight (on gloo a large send completes when the peer receives it), and one
    :class:`Pending` per send comes back, in ``ops``' order, whose ``wait()`` returns the sent
    tensor. Wait for it before the tensor is changed or its storage freed, and before the
    next collective that must see the transfer done; its errors surface there. A backend that
    completes the batch as one unit (NCCL's coalesced batch) is waited for whole, and its
    sends come back done. With ``wait_sends=True`` (the default) the list is empty.
    """
    p2p_ops, nbytes = [], 0
    for item in ops:
        op, tensor, peer = item
        if op not in ("send", "recv"):
            raise DistributedError(f"unknown p2p op {op!r}", fix="use 'send' or 'recv'")
        _check_peer(tensor, peer, op)
        ledger.record(group_name, op, _nbytes(tensor))
        nbytes += _nbytes(tensor)
        p2p_ops.append(dist.P2POp(dist.isend if op == "send" else dist.irecv, tensor, peer))
    if not p2p_ops:
        return []
    call = _p2p_call("batch_isend_irecv", sorted({item[2] for item in ops}), nbytes)
    waiting = watchdog.enter(call)
    sends: list[Pending] = []
    try:
        with call.guard():
            works = dist.batch_isend_irecv(p2p_ops)
            if wait_sends or len(works) != len(p2p_ops):  # all, or one work for the batch
                for work in works:
                    work.wait()
                works = [None] * len(p2p_ops)
            for work, (op, tensor, peer) in zip(works, ops, strict=True):
                if op == "recv" and work is not None:
                    work.wait()
                elif op == "send" and not wait_sends:
                    sends.append(_sent(work, tensor, peer))
    finally:
        watchdog.leave(waiting)
    return sends


def _sent(work: Any, tensor: torch.Tensor, peer: int) -> Pending:
    """A send of :func:`batch_isend_irecv` still in flight (``work``), or done (None)."""
    if work is None:
        return Pending.done(tensor)
    return Pending(work, lambda: tensor, _p2p_call("send", [peer], _nbytes(tensor)))


def _p2p_call(op: str, peers: list[int], nbytes: int = 0) -> Call:
    """A point-to-point call on the default group: a stuck or departed peer is one of ``peers``."""
    return Call(world_group(), op, 0, tuple(peers), nbytes)


def _check_dim(t: torch.Tensor, dim: int, op: str) -> int:
    if not -t.dim() <= dim < t.dim():
        raise DistributedError(f"{op} along dim {dim} of a {t.dim()}-d tensor", where=f"comm.{op}")
    return dim % t.dim()
