"""ZeRO stage 3: parameters partitioned at rest, gathered around each module's forward and backward.

:func:`partition_parameters` turns any ``nn.Module`` into a stage-3 module. Every parameter with
more than ``persistence_threshold`` elements is split by the rule of :mod:`zerotron.zero.partition`
(chunk ``ceil(n/N)``, rank r owns ``flat[r*chunk:(r+1)*chunk]``): the rank keeps its chunk in
``p.zero_shard`` and ``p.data`` becomes an empty tensor. Smaller parameters stay whole
(``p.zero_persistent = True``; the optimizer treats them as stage 2 does). Attributes of a
partitioned parameter (``notes/zero_api.md``)::

    p.zero_shard       1-D, ``chunk`` elements: this rank's chunk, zero-padded; p.dtype, or
                       once a ZeroOptimizer without offload owns the model, a view of its
                       fp32 master (one copy of the partition, cast as it is gathered)
    p.zero_shape       torch.Size of the full parameter (``p.shape`` is (0,) at rest)
    p.zero_numel       elements of the full parameter
    p.zero_persistent  False (True: kept whole)
    p.zero_modified    True after :class:`GatheredParameters` rewrote it (see below)

The life of a parameter in one training step (hooks on every submodule):

1. before a module's forward, its *own* parameters (``recurse=False``) and those registered
   with :func:`register_external_parameter` (or declared by the module's
   ``external_parameters()``, :mod:`zerotron.parallel.declarations`) are gathered: one
   ``all_gather`` of rank-major rows per fetch (all the module's parameters in one collective);
2. after its forward they are released (``p.data`` back to an empty tensor) and its outputs pass
   through a small autograd function whose backward gathers them again;
3. each parameter is released once its gradient has been accumulated (a post-accumulate-grad
   hook registered at partitioning, so it runs before the optimizer's: it only swaps ``p.data``,
   never touches ``p.grad``); whatever is still held when the backward ends is released then.

Gathers are reference-counted, so nesting is free: a parent that holds a tied weight, activation
recompute re-running a layer's forward inside backward (the recomputed layer keeps its parameters
for its own backward, which follows at once: parameters are gathered exactly twice per step with
or without recompute), :class:`GatheredParameters` blocks.

Prefetch: the order in which modules fetch is recorded in the first forward and the first
backward (separately); later passes that follow the same order start the gathers of the next
modules asynchronously, up to ``prefetch_bucket_size`` elements in flight and
``max_live_parameters`` gathered in all. Without a ``prefetch_bucket_size`` (zerotron's default;
a DeepSpeed config's default is 5e7) only the next module is gathered ahead, as FSDP2 does: in
backward a deeper prefetch holds parameters while the activations are at their peak. A pass
that departs from the recorded order stops prefetching and the next pass records afresh.

Saved activations: autograd keeps views of the weights it needs for backward (``linear`` saves
``weight.t()``), which would keep a released parameter's memory alive until backward. While a
stage-3 forward runs, a saved-tensor hook stores such a view as (parameter, shape, strides) and
rebuilds it from the re-gathered parameter in backward, so release really frees the memory
(what DeepSpeed's ``mem_efficient_linear`` does for linear layers, here for every op).

Optimizer contract: :class:`~zerotron.zero.optimizer.ZeroOptimizer` calls
:func:`partition_parameters` (unless the model has a coordinator already), builds its fp32
masters from :func:`read_shard`, reduce-scatters the full ``p.grad`` in its own
post-accumulate-grad hook and writes updated chunks back with :func:`write_shard`.
``p.zero_modified``, set by a :class:`GatheredParameters` block with ``modifier_rank`` or by
:func:`load_full_state_dict`, tells it to reload its master chunk (and clear the flag): see
:func:`modified_parameters`.

Offload (``offload_param``): with a ``param_store`` (:class:`zerotron.zero.offload.ParamStore`)
the shards rest in the store between uses and a fetch reads them from there. With ``cpu``,
``p.zero_shard`` is the store's host tensor itself; with ``nvme`` only the file holds the values
and ``p.zero_shard`` is an empty placeholder: go through :func:`read_shard` / :func:`write_shard`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from zerotron.distributed import comm
from zerotron.distributed.comm import Group, Pending
from zerotron.errors import ConfigError, DistributedError
from zerotron.parallel.declarations import external_parameters
from zerotron.zero.partition import BucketLayout, shard

__all__ = [
    "GatheredParameters",
    "ParamCoordinator",
    "ParamStore",
    "coordinator_of",
    "gathered_state_dict",
    "is_partitioned",
    "iter_partitioned",
    "load_full_state_dict",
    "modified_parameters",
    "partition_param",
    "partition_parameters",
    "read_shard",
    "register_external_parameter",
    "unregister_external_parameter",
    "write_shard",
]

# Status of a partitioned parameter.
RELEASED, INFLIGHT, AVAILABLE = "released", "inflight", "available"


class ParamStore(Protocol):
    """Where shards rest with ``offload_param``: :class:`zerotron.zero.offload.ParamStore`.

    ``put(key, shard)`` stores a copy of the values (host memory or a file); ``get(key)``
    returns them (for ``cpu`` the held tensor itself, for ``nvme`` a fresh one).
    """

    device: str

    def put(self, key: str, tensor: Tensor) -> None: ...

    def get(self, key: str, out: Tensor | None = None) -> Tensor: ...


# --------------------------------------------------------------------------------------------
# One parameter


class _ParamState:
    """Stage-3 bookkeeping of one parameter (``p._zero``; persistent ones have it too, for
    their group)."""

    __slots__ = (
        "group",
        "refs",
        "bwd_hold",
        "status",
        "fetch",
        "prefetched",
        "key",
        "store",
        "coordinator",
    )

    def __init__(self, group: Group, key: str, store: ParamStore | None):
        self.group = group
        self.refs = 0  # holders: module forwards, GatheredParameters blocks, the backward
        self.bwd_hold = False  # the current backward holds one ref until the grad is in
        self.status = RELEASED
        self.fetch: _Fetch | None = None  # the collective in flight, while INFLIGHT
        self.prefetched = False  # gathered ahead of its module, not yet claimed
        self.key = key
        self.store = store
        self.coordinator: ParamCoordinator | None = None  # set by partition_parameters


def is_partitioned(p: Tensor) -> bool:
    """True for a parameter held as a shard (not persistent)."""
    return hasattr(p, "zero_shard") and not getattr(p, "zero_persistent", True)


def _state(p: Tensor) -> _ParamState:
    return p._zero  # type: ignore[attr-defined]


def _full_shape(p: Tensor) -> torch.Size:
    shape = getattr(p, "zero_shape", None)
    return torch.Size(shape) if shape is not None else p.shape


def _empty_like_param(p: Tensor) -> Tensor:
    return torch.empty(0, dtype=p.dtype, device=p.device)


def read_shard(p: Tensor) -> Tensor:
    """This rank's chunk of a partitioned parameter (``chunk`` elements, zero-padded), wherever
    it rests: ``p.zero_shard``, or the param store with ``offload_param``."""
    st = _state(p)
    if st.store is not None and st.store.device == "nvme":
        return st.store.get(st.key)
    return p.zero_shard  # type: ignore[attr-defined]


def write_shard(p: Tensor, values: Tensor) -> None:
    """Replace this rank's chunk of ``p`` (``chunk`` elements; cast to ``p.dtype``).

    Use this rather than writing ``p.zero_shard`` when the parameters may be offloaded to NVMe
    (there ``p.zero_shard`` is an empty placeholder)."""
    st = _state(p)
    if st.store is None:
        own = p.zero_shard  # type: ignore[attr-defined]
        if not (own.data_ptr() == values.data_ptr() and own.dtype == values.dtype):
            own.copy_(values)  # (the optimizer's fp32 master may be the shard itself)
    elif st.store.device == "nvme":
        st.store.put(st.key, values.to(p.dtype))
    else:  # cpu (or none): p.zero_shard is the tensor the store holds
        p.zero_shard.copy_(values)  # type: ignore[attr-defined]


def partition_param(
    p: nn.Parameter,
    group: Group,
    *,
    persistence_threshold: int = int(1e5),
    key: str = "",
    store: ParamStore | None = None,
) -> bool:
    """Split one whole parameter over ``group``; keep it whole when it is small.

    Returns True when ``p`` was partitioned. A parameter that is already stage-3 is left alone.
    """
    if hasattr(p, "zero_persistent"):
        return is_partitioned(p)
    n = p.numel()
    p.zero_shape = p.shape
    p.zero_numel = n
    p.zero_modified = False
    p._zero = _ParamState(group, key or f"param{id(p)}", None)
    if n <= persistence_threshold:
        p.zero_persistent = True
        p._zero.status = AVAILABLE
        return False
    p.zero_persistent = False
    own = shard(p.data, group.size, group.rank)
    if store is None:
        p.zero_shard = own
    else:
        p._zero.store = store
        store.put(p._zero.key, own)
        # cpu: the store's host tensor is the shard; nvme: only the file holds it.
        p.zero_shard = own.new_empty(0) if store.device == "nvme" else store.get(p._zero.key)
    p.data = _empty_like_param(p)
    return True


def _gather_source(p: Tensor) -> Tensor:
    """The shard to all-gather, on the parameter's device, in its dtype (the shard may be a
    view of the optimizer's fp32 master: see ``ZeroOptimizer.shards_are_masters``)."""
    return read_shard(p).to(p.device, p.dtype, non_blocking=True)


def _write_full(p: Tensor, full: Tensor) -> None:
    """Re-partition ``full`` (the whole parameter) into this rank's shard."""
    st = _state(p)
    write_shard(p, shard(full.to(p.dtype), st.group.size, st.group.rank))


# --------------------------------------------------------------------------------------------
# Gathers: one all_gather of rank-major rows for several parameters


class _Fetch:
    """One all_gather in flight for some parameters; :meth:`finish` installs their full data."""

    def __init__(self, params: list[Tensor], group: Group):
        self.params = params
        self.layout = BucketLayout([_full_shape(p) for p in params], group.size, range(len(params)))
        shards = [_gather_source(p) for p in params]
        row = shards[0] if len(shards) == 1 else torch.cat(shards)
        self.pending: Pending | None = comm.all_gather_async(row, group)
        # One parameter's rows are its chunks in order: the buffer is the parameter (no copy).
        # At size 1 the "gathered" buffer is the shard itself, which must not be aliased.
        self.in_place = len(params) == 1 and group.size > 1
        for p in params:
            st = _state(p)
            st.status, st.fetch = INFLIGHT, self
            if st.coordinator is not None:
                st.coordinator.live_numel += p.zero_numel  # type: ignore[attr-defined]

    def finish(self) -> None:
        if self.pending is None:
            return
        buf = self.pending.wait()
        self.pending = None
        if self.in_place:
            p = self.params[0]
            fulls = [buf.view(-1)[: p.zero_numel].view(_full_shape(p))]  # type: ignore[attr-defined]
        else:
            fulls = self.layout.unpack(buf)  # new tensors (a copy out of the strided columns)
        for p, full in zip(self.params, fulls):
            st = _state(p)
            p.data = full
            st.status, st.fetch = AVAILABLE, None
            if st.coordinator is not None:
                st.coordinator._on_available(p)


def _start_fetches(params: list[Tensor]) -> list[_Fetch]:
    """Start gathering ``params`` (released ones): one collective per (group, dtype, device)."""
    by_key: dict[tuple, list[Tensor]] = {}
    for p in params:
        st = _state(p)
        by_key.setdefault((st.group.name, st.group.ranks, p.dtype, p.device), []).append(p)
    return [_Fetch(ps, _state(ps[0]).group) for ps in by_key.values()]


def _take_ref(p: Tensor) -> None:
    st = _state(p)
    st.refs += 1
    if st.prefetched:  # claimed: no longer counts against the prefetch budget
        st.prefetched = False
        if st.coordinator is not None:
            st.coordinator._prefetched_numel -= p.zero_numel  # type: ignore[attr-defined]


def _make_available(params: list[Tensor], prefetch: Any = None) -> None:
    """Gather those of ``params`` that are released (one collective), start ``prefetch()``
    meanwhile, and wait until all of ``params`` are there."""
    fetches = _start_fetches([p for p in params if _state(p).status == RELEASED])
    if prefetch is not None:
        prefetch()
    for p in params:
        fetch = _state(p).fetch
        if fetch is not None:
            fetch.finish()
    for f in fetches:
        f.finish()


def _drop_ref(p: Tensor) -> None:
    st = _state(p)
    st.refs -= 1
    if st.refs < 0:
        raise DistributedError(
            f"stage-3 parameter {st.key} released more often than gathered", where="zero.stage3"
        )
    if st.refs == 0:
        _free(p)


def _free(p: Tensor) -> None:
    """Drop the full data of ``p`` (finishing its collective first if one is in flight)."""
    st = _state(p)
    if st.fetch is not None:
        st.fetch.finish()  # a collective cannot be abandoned half-way
    if st.status == AVAILABLE:
        if st.coordinator is not None:
            st.coordinator._on_free(p)
        p.data = _empty_like_param(p)
        st.status = RELEASED
        st.prefetched = False


# --------------------------------------------------------------------------------------------
# External parameters


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Gather ``parameter`` for the whole forward and backward of ``module``.

    For a parameter that ``module``'s forward uses although another module owns it (a tied
    output layer, ``child.weight`` read directly). DeepSpeed's API of the same name.
    """
    ext = module.__dict__.setdefault("_zero_external_params", {})
    ext[id(parameter)] = parameter


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Undo :func:`register_external_parameter`."""
    module.__dict__.get("_zero_external_params", {}).pop(id(parameter), None)


def _register_declared_externals(root: nn.Module) -> None:
    """Register the parameters each module declares it reads outside their owners
    (``external_parameters()``, :mod:`zerotron.parallel.declarations`)."""
    for m in root.modules():
        for p in external_parameters(m):
            register_external_parameter(m, p)


# --------------------------------------------------------------------------------------------
# The order modules fetch in, for prefetching


class _Trace:
    """The modules' fetch order in one kind of pass (forward or backward)."""

    def __init__(self) -> None:
        self.order: list[nn.Module] | None = None
        self.recording: list[nn.Module] | None = None
        self.pos = 0
        self.broken = False

    def begin(self) -> None:
        self.pos, self.broken = 0, False
        if self.order is None:
            self.recording = []

    def step(self, module: nn.Module) -> list[nn.Module]:
        """Note that ``module`` fetches now; return the modules expected next (to prefetch)."""
        if self.order is None:
            if self.recording is not None:
                self.recording.append(module)
            return []
        if self.broken:
            return []
        if self.pos < len(self.order) and self.order[self.pos] is module:
            self.pos += 1
            return self.order[self.pos :]
        self.invalidate()
        return []

    def invalidate(self) -> None:
        self.order, self.recording, self.broken = None, None, True

    def end(self) -> None:
        if self.order is None and self.recording is not None:
            self.order = self.recording
        elif self.order is not None and not self.broken and self.pos != len(self.order):
            self.invalidate()  # the pass stopped early: the order is not what we recorded
        self.recording = None


# --------------------------------------------------------------------------------------------
# Saved activations that are views of gathered parameters


class _SavedParamView:
    __slots__ = ("param", "size", "stride", "offset")

    def __init__(self, param: Tensor, t: Tensor):
        self.param = param
        self.size = t.size()
        self.stride = t.stride()
        self.offset = t.storage_offset() - param.data.storage_offset()


class _BackwardToken:
    """Shared by the autograd functions on one module call's outputs: fire once per backward."""

    __slots__ = ("coordinator", "module", "fired_in")

    def __init__(self, coordinator: ParamCoordinator, module: nn.Module):
        self.coordinator = coordinator
        self.module = module
        self.fired_in: int | None = None


class _PreBackward(torch.autograd.Function):
    """Identity in forward; in backward, gathers the module's parameters before its gradients."""

    @staticmethod
    def forward(ctx: Any, token: _BackwardToken, x: Tensor) -> Tensor:
        ctx.token = token
        return x.detach()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor]:
        token: _BackwardToken = ctx.token
        task = torch._C._current_graph_task_id()
        if token.fired_in != task:
            token.fired_in = task
            token.coordinator._pre_backward(token.module)
        return None, grad


# --------------------------------------------------------------------------------------------
# The coordinator


class ParamCoordinator:
    """Stage-3 parameters of one module tree: partitioning, hooks, prefetch, release.

    Built by :func:`partition_parameters`; find it again with :func:`coordinator_of`.
    ``params`` lists the partitioned parameters (``named_parameters`` order), ``live_numel``
    counts the elements gathered or in flight right now (``peak_live_numel``: the most so far),
    ``prefetches`` the module fetches started ahead of use.
    """

    def __init__(
        self,
        module: nn.Module,
        group: Group,
        *,
        persistence_threshold: int = int(1e5),
        prefetch_bucket_size: int | None = None,
        max_live_parameters: int = int(1e9),
        param_store: ParamStore | None = None,
    ):
        sizes = (prefetch_bucket_size or 0, max_live_parameters, persistence_threshold)
        if min(sizes) < 0:
            raise ConfigError(
                f"stage-3 sizes must be >= 0 (prefetch_bucket_size={prefetch_bucket_size}, "
                f"max_live_parameters={max_live_parameters}, "
                f"param_persistence_threshold={persistence_threshold})",
                where="zero_optimization.stage3_*",
            )
        self.module = module
        self.group = group
        self.persistence_threshold = int(persistence_threshold)
        self.prefetch_bucket_size = (
            None if prefetch_bucket_size is None else int(prefetch_bucket_size)
        )
        """Elements gathered ahead of use at most; None: the next module only."""
        self.max_live_parameters = int(max_live_parameters)
        self.param_store = param_store
        self.params: list[nn.Parameter] = []
        self.live_numel = 0
        self.peak_live_numel = 0  # the most elements gathered or in flight at once
        self.prefetches = 0  # modules whose gather started ahead of their use
        self._prefetched_numel = 0  # prefetched, not yet claimed by their module
        self._storage_owner: dict[int, Tensor] = {}  # gathered storage -> its parameter
        self._fwd_depth = 0
        self._saved_hooks: Any = None
        self._traces = {"fwd": _Trace(), "bwd": _Trace()}
        self._bwd_task: int | None = None
        self._handles: list[Any] = []
        self._partition()
        _register_declared_externals(module)
        self._install_hooks()

    def __deepcopy__(self, memo: dict) -> ParamCoordinator:
        # torch copies a Parameter as its (empty) data alone: the copy would be unusable.
        raise ConfigError(
            "a stage-3 module cannot be deep-copied (its parameters are empty shards)",
            where="zero.stage3",
            fix="copy the module before partition_parameters(), or build a new one and "
            "load_full_state_dict(gathered_state_dict(...)) into it",
        )

    # -- setup -------------------------------------------------------------------------------

    def _partition(self) -> None:
        for name, p in self.module.named_parameters():
            if hasattr(p, "zero_persistent"):  # partitioned earlier (zero.Init)
                if is_partitioned(p):
                    self._check_group(name, p)
                    self._adopt(p)
            elif partition_param(
                p,
                self.group,
                persistence_threshold=self.persistence_threshold,
                key=name,
                store=self.param_store,
            ):
                self._adopt(p)

    def _check_group(self, name: str, p: Tensor) -> None:
        st = _state(p)
        g = st.group
        if (g.ranks, g.rank) != (self.group.ranks, self.group.rank):
            raise DistributedError(
                f"parameter {name} was partitioned over {g} but the stage-3 group is {self.group}",
                where="zero.stage3.partition_parameters",
                fix="build the model under zero.Init with the same data_parallel_group",
            )
        if st.coordinator is not None:
            raise ConfigError(
                f"parameter {name} already belongs to another stage-3 module",
                where="zero.stage3.partition_parameters",
            )

    def _adopt(self, p: nn.Parameter) -> None:
        st = _state(p)
        st.coordinator = self
        self.params.append(p)
        if p.requires_grad:  # registered now, so it runs before the optimizer's hook
            self._handles.append(p.register_post_accumulate_grad_hook(self._after_grad))

    def _install_hooks(self) -> None:
        # Bookkeeping and collectives, not tensor math: torch.compile runs them eagerly.
        pre, post = (
            torch.compiler.disable(self._pre_forward),
            torch.compiler.disable(self._post_forward),
        )
        for m in self.module.modules():
            self._handles.append(m.register_forward_pre_hook(pre, prepend=True))
            self._handles.append(m.register_forward_hook(post, always_call=True))
        self.module.__dict__["_zero3_coordinator"] = self

    def remove_hooks(self) -> None:
        """Detach from the module (parameters stay partitioned; see :meth:`unpartition`)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.module.__dict__.pop("_zero3_coordinator", None)
        for p in self.params:
            _state(p).coordinator = None

    def unpartition(self) -> None:
        """Make every parameter whole again on every rank and drop stage 3 (collective)."""
        self.release_all()
        full = [_gather_now(p) for p in self.params]
        params = list(self.params)
        self.remove_hooks()
        for p, data in zip(params, full):
            p.data = data
            for attr in ("zero_shard", "zero_shape", "zero_numel", "zero_persistent"):
                delattr(p, attr)
            del p.zero_modified, p._zero
        self.params.clear()

    # -- which parameters a module needs -------------------------------------------------------

    @staticmethod
    def _fetch_list(module: nn.Module) -> list[Tensor]:
        own = [p for p in module._parameters.values() if p is not None and is_partitioned(p)]
        ext = module.__dict__.get("_zero_external_params")
        if ext:
            own += [p for p in ext.values() if is_partitioned(p) and all(p is not q for q in own)]
        return own

    # -- hooks ---------------------------------------------------------------------------------

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        task = torch._C._current_graph_task_id()
        if task != -1:  # a forward inside backward: activation recompute
            self._pre_backward(module)
            return
        if self._fwd_depth == 0:
            self._traces["fwd"].begin()
            # Saved views of gathered weights refer to the parameter, not its memory.
            self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._saved_hooks.__enter__()
        self._fwd_depth += 1
        params = self._fetch_list(module)
        # What this call holds, released as is after it (registrations may change meanwhile).
        module.__dict__.setdefault("_zero_fwd_held", []).append(params)
        if params:
            upcoming = self._traces["fwd"].step(module)
            for p in params:
                _take_ref(p)
            _make_available(params, lambda: self._prefetch(upcoming))

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        if torch._C._current_graph_task_id() != -1:
            return output  # recompute: the parameters stay for the backward that follows
        held = module.__dict__.get("_zero_fwd_held")
        if not held:  # the pre-hook failed before taking anything (the error propagates)
            return output
        params = held.pop()
        for p in params:
            _drop_ref(p)
        if torch.is_grad_enabled() and (params or self._fetch_list(module)):
            output = _wrap_outputs(output, _BackwardToken(self, module))
        self._fwd_depth -= 1
        if self._fwd_depth == 0:
            if self._saved_hooks is not None:
                self._saved_hooks.__exit__(None, None, None)
                self._saved_hooks = None
            self._traces["fwd"].end()
            self._release_unclaimed()
        return output

    def _pre_backward(self, module: nn.Module) -> None:
        """Before ``module``'s backward (or its recomputed forward): hold its parameters until
        their gradients are in."""
        self._ensure_backward_pass(torch._C._current_graph_task_id())
        params = self._fetch_list(module)
        if params:
            upcoming = self._traces["bwd"].step(module)
            self._hold_for_backward(params, lambda: self._prefetch(upcoming))

    def _hold_for_backward(self, params: list[Tensor], prefetch: Any = None) -> None:
        for p in params:
            st = _state(p)
            if not st.bwd_hold:
                st.bwd_hold = True
                _take_ref(p)
        _make_available(params, prefetch)

    def _ensure_backward_pass(self, task: int) -> None:
        if self._bwd_task == task:
            return
        self._bwd_task = task
        self._traces["bwd"].begin()
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        self._bwd_task = None
        self._traces["bwd"].end()
        for p in self.params:  # no gradient came (frozen or unused): release now
            st = _state(p)
            if st.bwd_hold:
                st.bwd_hold = False
                _drop_ref(p)
        self._release_unclaimed()

    def _after_grad(self, p: Tensor) -> None:
        st = _state(p)
        if st.bwd_hold:
            st.bwd_hold = False
            _drop_ref(p)

    # -- prefetch and accounting ---------------------------------------------------------------

    def _prefetch(self, upcoming: list[nn.Module]) -> None:
        """Start gathering the next modules' parameters within the prefetch budgets (without a
        ``prefetch_bucket_size``: the next module's, whatever its size)."""
        if self.prefetch_bucket_size is None:
            upcoming = upcoming[:1]
        for module in upcoming:
            todo = [p for p in self._fetch_list(module) if _state(p).status == RELEASED]
            if not todo:
                continue
            numel = sum(p.zero_numel for p in todo)  # type: ignore[attr-defined]
            bucket = self.prefetch_bucket_size
            if (
                bucket is not None and self._prefetched_numel + numel > bucket
            ) or self.live_numel + numel > self.max_live_parameters:
                return
            for p in todo:
                _state(p).prefetched = True
            self._prefetched_numel += numel
            self.prefetches += 1
            _start_fetches(todo)

    def _on_available(self, p: Tensor) -> None:
        self._storage_owner[p.data.untyped_storage().data_ptr()] = p
        self.peak_live_numel = max(self.peak_live_numel, self.live_numel)

    def _on_free(self, p: Tensor) -> None:
        self._storage_owner.pop(p.data.untyped_storage().data_ptr(), None)
        self.live_numel -= p.zero_numel  # type: ignore[attr-defined]
        if _state(p).prefetched:
            self._prefetched_numel -= p.zero_numel  # type: ignore[attr-defined]

    def _release_unclaimed(self) -> None:
        """Free what was prefetched but never claimed (the pass went another way)."""
        for p in self.params:
            st = _state(p)
            if st.refs == 0 and st.status != RELEASED:
                _free(p)

    def release_all(self) -> None:
        """Free every gathered parameter and forget all holds (after an error, say)."""
        for p in self.params:
            st = _state(p)
            st.refs, st.bwd_hold = 0, False
            _free(p)

    def gathered_numel(self) -> int:
        """Elements of partitioned parameters whole on this rank right now."""
        return sum(p.numel() for p in self.params)

    # -- saved tensors -------------------------------------------------------------------------

    def _pack(self, t: Tensor) -> Any:
        try:
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # no storage (sparse, nested, ...)
            return t
        p = self._storage_owner.get(ptr) if ptr else None
        if p is None or t.dtype != p.dtype:
            return t
        return _SavedParamView(p, t)

    def _unpack(self, saved: Any) -> Tensor:
        if not isinstance(saved, _SavedParamView):
            return saved
        p = saved.param
        if _state(p).status != AVAILABLE:  # used outside any module that fetches it
            self._ensure_backward_pass(torch._C._current_graph_task_id())
            self._hold_for_backward([p])
        data = p.data
        return data.as_strided(saved.size, saved.stride, data.storage_offset() + saved.offset)


def _wrap_outputs(output: Any, token: _BackwardToken) -> Any:
    """Pass every grad-requiring tensor in ``output`` through :class:`_PreBackward`."""
    if isinstance(output, Tensor):
        if output.requires_grad:
            return _PreBackward.apply(token, output)
        return output
    if isinstance(output, tuple) and hasattr(output, "_fields"):  # namedtuple
        return type(output)(*(_wrap_outputs(o, token) for o in output))
    if isinstance(output, (tuple, list)):
        return type(output)(_wrap_outputs(o, token) for o in output)
    if isinstance(output, dict):
        return type(output)((k, _wrap_outputs(v, token)) for k, v in output.items())
    return output


def _gather_now(p: Tensor) -> Tensor:
    """The full parameter as a new tensor (one collective; ``p`` itself is not changed)."""
    st = _state(p)
    if st.status == AVAILABLE:
        return p.data.clone()
    layout = BucketLayout([_full_shape(p)], st.group.size, [0])
    buf = comm.all_gather(_gather_source(p), st.group)
    return layout.unpack(buf)[0]


# --------------------------------------------------------------------------------------------
# Public functions


def partition_parameters(
    module: nn.Module,
    group: Group | None = None,
    *,
    persistence_threshold: int = int(1e5),
    prefetch_bucket_size: int | None = None,
    max_live_parameters: int = int(1e9),
    param_store: ParamStore | None = None,
) -> ParamCoordinator:
    """Make ``module`` a stage-3 module over ``group`` (default: the data-parallel group).

    Parameters already partitioned (built under :class:`Init`) are adopted as they are. Returns
    the :class:`ParamCoordinator` (also :func:`coordinator_of`).
    """
    if coordinator_of(module) is not None:
        raise ConfigError(
            "partition_parameters() on a module that is already stage-3",
            where="zero.stage3",
            fix="use coordinator_of(module)",
        )
    if group is None:
        from zerotron.distributed.state import state

        group = state().dp
    return ParamCoordinator(
        module,
        group,
        persistence_threshold=persistence_threshold,
        prefetch_bucket_size=prefetch_bucket_size,
        max_live_parameters=max_live_parameters,
        param_store=param_store,
    )


def coordinator_of(module: nn.Module) -> ParamCoordinator | None:
    """The coordinator :func:`partition_parameters` attached to ``module``, if any."""
    return module.__dict__.get("_zero3_coordinator")


class GatheredParameters:
    """Gather stage-3 parameters for the duration of a ``with`` block (collective).

    ``params``: one parameter or an iterable (parameters that are not stage-3 pass through).
    With ``modifier_rank`` r, the values rank r leaves in the parameters when the block ends are
    broadcast to every rank and re-partitioned (persistent parameters are broadcast too), and
    each gets ``p.zero_modified = True`` so that an optimizer reloads its master weights;
    without it, changes made inside the block are lost. ``fwd_module``: the parameters are
    registered as external parameters of that module (and stay registered, so that its backward
    gathers them too: for a forward that uses another module's parameter inside the block).
    DeepSpeed's semantics.
    """

    def __init__(
        self,
        params: Tensor | Iterable[Tensor],
        modifier_rank: int | None = None,
        fwd_module: nn.Module | None = None,
        enabled: bool = True,
    ):
        plist = [params] if isinstance(params, Tensor) else list(params)
        self.enabled = enabled
        self.modifier_rank = modifier_rank
        self.fwd_module = fwd_module
        self.params = _unique(p for p in plist if is_partitioned(p))
        self.persistent = _unique(p for p in plist if getattr(p, "zero_persistent", False))

    def __enter__(self) -> GatheredParameters:
        if self.enabled:
            for p in self.params:
                _take_ref(p)
            _make_available(self.params)
            if self.fwd_module is not None:
                for p in self.params:
                    register_external_parameter(self.fwd_module, p)
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.enabled:
            return
        try:
            if self.modifier_rank is not None and exc[0] is None:
                self._broadcast_and_repartition(self.modifier_rank)
        finally:
            for p in self.params:
                _drop_ref(p)

    def _broadcast_and_repartition(self, src: int) -> None:
        groups: dict[tuple, list[Tensor]] = {}
        for p in self.params + self.persistent:
            g = _state(p).group
            groups.setdefault((g.name, g.ranks, p.dtype, p.device), []).append(p)
        for ps in groups.values():
            flat = torch.cat([p.data.reshape(-1) for p in ps])  # one broadcast per group
            comm.broadcast(flat, _state(ps[0]).group, src)
            offset = 0
            with torch.no_grad():
                for p in ps:
                    n = p.numel()
                    p.data.copy_(flat[offset : offset + n].view_as(p.data))
                    offset += n
                    if is_partitioned(p):
                        _write_full(p, p.data)
                    p.zero_modified = True


def _unique(params: Iterable[Tensor]) -> list[Tensor]:
    out: list[Tensor] = []
    for p in params:
        if all(p is not q for q in out):
            out.append(p)
    return out


def modified_parameters(params: Iterable[Tensor]) -> list[Tensor]:
    """Those of ``params`` rewritten behind the optimizer's back (by :class:`GatheredParameters`
    with ``modifier_rank`` or :func:`load_full_state_dict`) since their flag was cleared. An
    optimizer reloads their master chunks from :func:`read_shard` (persistent ones: from
    ``p``) and sets ``p.zero_modified = False``."""
    return [p for p in params if getattr(p, "zero_modified", False)]


# --------------------------------------------------------------------------------------------
# Full state dicts


def gathered_state_dict(
    module: nn.Module, rank0_only: bool = True, group: Group | None = None
) -> dict[str, Tensor] | None:
    """The module's state dict with every stage-3 parameter whole (collective).

    Parameters are gathered one at a time and copied to host memory; with ``rank0_only`` only
    data-parallel rank 0 keeps them (the others return None): what
    ``stage3_gather_16bit_weights_on_model_save`` writes as the model file.
    """
    sd = module.state_dict(keep_vars=True)
    if group is None:
        group = next((_state(t).group for t in sd.values() if is_partitioned(t)), None)
    if group is None:
        from zerotron.distributed.state import state

        group = state().dp
    keep = group.rank == 0 or not rank0_only
    out: dict[str, Tensor] = {}
    for name, t in sd.items():
        full = _gather_now(t) if isinstance(t, Tensor) and is_partitioned(t) else t
        if keep:
            out[name] = full.detach().to("cpu", copy=True) if isinstance(full, Tensor) else full
    return out if keep else None


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
                if torch.Size(src.shape) != _full_shape(t):
                    raise ConfigError(
                        f"{name}: shape {tuple(src.shape)} != {tuple(_full_shape(t))}",
                        where="zero.stage3.load_full_state_dict",
                    )
                _write_full(t, src.to(t.dtype))
                t.zero_modified = True
                if _state(t).status == AVAILABLE:
                    t.data.copy_(src.view_as(t.data))
            else:
                t.copy_(src)
                if getattr(t, "zero_persistent", False):
                    t.zero_modified = True


def iter_partitioned(module: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` for every partitioned parameter of ``module``."""
    for name, p in module.named_parameters():
        if is_partitioned(p):
            yield name, p


def __getattr__(name: str) -> Any:
    # Init lives in zerotron.zero.init (it imports this module); reachable from here too.
    if name == "Init":
        from zerotron.zero.init import Init

        return Init
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
