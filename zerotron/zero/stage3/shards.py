"""ZeRO stage 3, one parameter: its shard, where the shard rests, and its bookkeeping.

A stage-3 parameter carries DeepSpeed's attributes, with their meaning (client code written for
DeepSpeed reads them)::

    p.ds_id        int, unique per parameter (the same on every rank for the same model)
    p.ds_status    ZeroParamStatus: AVAILABLE while whole, NOT_AVAILABLE at rest, INFLIGHT
                   while its gather runs (persistent parameters: always AVAILABLE)
    p.ds_shape     torch.Size of the whole parameter (``p.shape`` is (0,) at rest)
    p.ds_numel     elements of the whole parameter
    p.ds_persist   True for a small parameter kept whole (not partitioned)
    p.ds_tensor    partitioned ones only: this rank's chunk (the rule of
                   :mod:`zerotron.zero.partition`), 1-D, zero-padded

and ``p.zero_modified`` (see :func:`modified_parameters`). Its other stage-3 state (process
group, references, the fetch in flight) is a :class:`ParamState` at ``p._zero``. A partitioned
parameter pickles (``torch.save``) as a plain parameter of its current data, empty at rest, as
DeepSpeed's do: none of that state, which belongs to this process, is saved. With
``offload_param`` the shard rests in a :class:`ShardStore`
(:class:`~zerotron.zero.offload.ParamOffloadStore`): read and write it through
:func:`read_shard` / :func:`write_shard`, never ``p.ds_tensor`` directly (with ``nvme`` it is an
empty placeholder, as DeepSpeed's is while the partition is on disk).

Partitioning broadcasts data-parallel rank 0's values first (:func:`partition_param`), as
DeepSpeed's ``zero.Init`` does: every rank holds chunks of one model, whatever each rank's seed.

Loading whole tensors into shards (:func:`load_full_state_dict`) and telling an optimizer which
shards changed behind its back (:func:`modified_parameters`) live here too: both only touch
this rank's chunk, with no collective.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from zerotron.distributed import comm
from zerotron.distributed.comm import Group
from zerotron.errors import ConfigError
from zerotron.zero.partition import full_shape, shard

if TYPE_CHECKING:
    from zerotron.zero.stage3.coordinator import ParamCoordinator
    from zerotron.zero.stage3.gather import Fetch


class ZeroParamStatus(enum.Enum):
    """Status of a partitioned parameter, with DeepSpeed's names and values (its client code
    compares ``p.ds_status`` with these)."""

    AVAILABLE = 1  # gathered: p.data is the whole parameter
    NOT_AVAILABLE = 2  # released: only this rank's shard is held
    INFLIGHT = 3  # a gather has started and not finished


RELEASED = ZeroParamStatus.NOT_AVAILABLE
INFLIGHT = ZeroParamStatus.INFLIGHT
AVAILABLE = ZeroParamStatus.AVAILABLE


class ShardStore(Protocol):
    """Where shards rest with ``offload_param``: :class:`zerotron.zero.offload.ParamOffloadStore`.

    ``put(key, shard)`` stores a copy of the values (host memory or a file); ``get(key)``
    returns them (for ``cpu`` the held tensor itself, for ``nvme`` a fresh one).
    """

    device: str

    def put(self, key: str, tensor: Tensor) -> None: ...

    def get(self, key: str, out: Tensor | None = None) -> Tensor: ...


# --------------------------------------------------------------------------------------------
# One parameter


class ParamState:
    """Stage-3 bookkeeping of one parameter (``p._zero``; persistent ones have it too, for
    their group). Its status is ``p.ds_status``."""

    __slots__ = (
        "group",
        "refs",
        "bwd_hold",
        "reuse_hold",
        "fetch",
        "prefetched",
        "key",
        "store",
        "coordinator",
    )

    def __init__(self, group: Group, key: str, store: ShardStore | None):
        self.group = group
        self.refs = 0  # holders: module forwards, GatheredParameters blocks, the backward
        self.bwd_hold = False  # the current backward holds one ref until the grad is in
        self.reuse_hold = False  # kept gathered after a use, for its next use soon after
        self.fetch: Fetch | None = None  # the collective in flight, while INFLIGHT
        self.prefetched = False  # gathered ahead of its module, not yet claimed
        self.key = key
        self.store = store
        self.coordinator: ParamCoordinator | None = None  # set by partition_parameters


def is_partitioned(p: Tensor) -> bool:
    """True for a parameter held as a shard (not persistent)."""
    return getattr(p, "ds_persist", True) is False


def is_zero_param(p: Tensor) -> bool:
    """True for a stage-3 parameter, partitioned or persistent (DeepSpeed's test: ``ds_id``)."""
    return hasattr(p, "ds_id")


def state_of(p: Tensor) -> ParamState:
    return p._zero  # type: ignore[attr-defined]


def empty_like_param(p: Tensor) -> Tensor:
    return torch.empty(0, dtype=p.dtype, device=p.device)


def read_shard(p: Tensor) -> Tensor:
    """This rank's chunk of a partitioned parameter (``chunk`` elements, zero-padded), wherever
    it rests: ``p.ds_tensor``, or the param store with ``offload_param``."""
    st = state_of(p)
    if st.store is not None and st.store.device == "nvme":
        return st.store.get(st.key)
    return p.ds_tensor  # type: ignore[attr-defined]


def write_shard(p: Tensor, values: Tensor) -> None:
    """Replace this rank's chunk of ``p`` (``chunk`` elements; cast to ``p.dtype``).

    Use this rather than writing ``p.ds_tensor`` when the parameters may be offloaded to NVMe
    (there ``p.ds_tensor`` is an empty placeholder)."""
    st = state_of(p)
    if st.store is None:
        own = p.ds_tensor  # type: ignore[attr-defined]
        if not (own.data_ptr() == values.data_ptr() and own.dtype == values.dtype):
            own.copy_(values)  # (the optimizer's fp32 master may be the shard itself)
    elif st.store.device == "nvme":
        st.store.put(st.key, values.to(p.dtype))
    else:  # cpu (or none): p.ds_tensor is the tensor the store holds
        p.ds_tensor.copy_(values)  # type: ignore[attr-defined]


_ids = itertools.count()  # ds_id: the same sequence on every rank that builds the same model


def _no_pickled_state() -> dict:
    """``p.__getstate__`` of a stage-3 parameter: pickle it as a plain parameter of its data.

    ``torch.save`` saves a parameter's ``__dict__`` (``_get_obj_state``); ours holds this
    process's state (a process group, the coordinator) that cannot be pickled, and attributes
    ``torch.load(weights_only=True)`` would refuse (an enum). DeepSpeed's partitioned
    parameters are saved as their (empty) data; so are these."""
    return {}


def partition_param(
    p: nn.Parameter,
    group: Group,
    *,
    persistence_threshold: int = int(1e5),
    key: str = "",
    store: ShardStore | None = None,
) -> bool:
    """Make one whole parameter stage-3 over ``group``: split it, or keep it whole when it is
    small (at most ``persistence_threshold`` elements).

    Collective: first the values of group rank 0 are broadcast into ``p`` (DeepSpeed's
    ``zero.Init`` does the same), so a script that seeds each rank differently still trains one
    model. Returns True when ``p`` was partitioned. A parameter that is already stage-3 is left
    alone (no collective).
    """
    if is_zero_param(p):
        return is_partitioned(p)
    _broadcast_from_rank0(p, group)
    n = p.numel()
    p.ds_id = next(_ids)
    p.ds_shape = p.shape
    p.ds_numel = n
    p.zero_modified = False
    p._zero = ParamState(group, key or f"param{p.ds_id}", None)
    p.__getstate__ = _no_pickled_state
    if n <= persistence_threshold:
        p.ds_persist = True
        p.ds_status = AVAILABLE
        return False
    p.ds_persist = False
    own = shard(p.data, group.size, group.rank)
    if store is None:
        p.ds_tensor = own
    else:
        p._zero.store = store
        store.put(p._zero.key, own)
        # cpu: the store's host tensor is the shard; nvme: only the file holds it.
        p.ds_tensor = own.new_empty(0) if store.device == "nvme" else store.get(p._zero.key)
    p.data = empty_like_param(p)
    p.ds_status = RELEASED
    return True


def _broadcast_from_rank0(p: Tensor, group: Group) -> None:
    """Group rank 0's value of ``p`` into every member's ``p``. A CPU tensor (a module built
    under ``zero.Init`` on a GPU machine) travels through the current GPU when the group's
    backend carries only GPU tensors (nccl)."""
    if group.pg is None or group.size == 1:
        return
    data = p.data
    if data.device.type == "cpu" and not any(
        b in str(dist.get_backend(group.pg)) for b in _CPU_BACKENDS
    ):
        staged = comm.broadcast(
            data.to(torch.device("cuda", torch.cuda.current_device())), group, 0
        )
        data.copy_(staged)
    else:
        comm.broadcast(data, group, 0)


_CPU_BACKENDS = ("gloo", "mpi")


def drop_stage3_attributes(p: Tensor) -> None:
    """Forget that ``p`` was stage-3 (its data must be whole again): the inverse of
    :func:`partition_param`'s bookkeeping."""
    for attr in STAGE3_ATTRIBUTES:
        p.__dict__.pop(attr, None)


STAGE3_ATTRIBUTES = (
    "ds_id",
    "ds_status",
    "ds_shape",
    "ds_numel",
    "ds_persist",
    "ds_tensor",
    "zero_modified",
    "_zero",
    "__getstate__",
)


def gather_source(p: Tensor) -> Tensor:
    """The shard to all-gather, on the parameter's device, in its dtype (the shard may be a
    view of the optimizer's fp32 master: see ``ZeroOptimizer.shards_are_masters``)."""
    return read_shard(p).to(p.device, p.dtype, non_blocking=True)


def write_full(p: Tensor, full: Tensor) -> None:
    """Re-partition ``full`` (the whole parameter) into this rank's shard."""
    st = state_of(p)
    write_shard(p, shard(full.to(p.dtype), st.group.size, st.group.rank))


def modified_parameters(params: Iterable[Tensor]) -> list[Tensor]:
    """Those of ``params`` rewritten behind the optimizer's back (by :class:`GatheredParameters`
    with ``modifier_rank`` or :func:`load_full_state_dict`) since their flag was cleared. An
    optimizer reloads their master chunks from :func:`read_shard` (persistent ones: from
    ``p``) and sets ``p.zero_modified = False``."""
    return [p for p in params if getattr(p, "zero_modified", False)]


def load_full_state_dict(module: nn.Module, state_dict: Mapping[str, Tensor]) -> None:
    """Load whole tensors (e.g. a model file every rank read) into a stage-3 module: each rank
    keeps its chunk of each partitioned parameter; everything else loads as usual. No collective.
    """
    own = module.state_dict(keep_vars=True)
    missing = sorted(set(own) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(own))
    if missing or unexpected:
        raise ConfigError(
            f"state dict does not fit the module: missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}",
            where="zero.stage3.load_full_state_dict",
        )
    with torch.no_grad():
        for name, t in own.items():
            src = state_dict[name]
            if not isinstance(t, Tensor):  # extra state: the module's own business
                continue
            if is_partitioned(t):
                if torch.Size(src.shape) != full_shape(t):
                    raise ConfigError(
                        f"{name}: shape {tuple(src.shape)} != {tuple(full_shape(t))}",
                        where="zero.stage3.load_full_state_dict",
                    )
                write_full(t, src.to(t.dtype))
                t.zero_modified = True
                if t.ds_status == AVAILABLE:
                    t.data.copy_(src.view_as(t.data))
            else:
                t.copy_(src)
                if getattr(t, "ds_persist", False):
                    t.zero_modified = True


def iter_partitioned(module: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` for every partitioned parameter of ``module``."""
    for name, p in module.named_parameters():
        if is_partitioned(p):
            yield name, p
