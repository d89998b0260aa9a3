"""ZeRO stage 3, coordination: hooks on every submodule that gather, prefetch and release.

:class:`ParamCoordinator` (built by :func:`partition_parameters`) partitions a module tree's
parameters (:mod:`~zerotron.zero.stage3.shards`), then, on every submodule, gathers its
parameters before its forward and releases them after, re-gathers them before its backward
and releases each once its gradient is in (gathering itself: :mod:`~zerotron.zero.stage3.gather`).
It records the order modules fetch in (a :class:`_Trace` per pass) to prefetch the next ones
and, with a ``max_reuse_distance``, to keep a parameter gathered from one use to a next use that
comes soon enough (:class:`_ReusePlan`); and it keeps autograd's saved views of gathered weights
as references to the parameter so a release really frees memory. The life of a parameter is
told in :mod:`zerotron.zero.stage3`.
"""

from __future__ import annotations

import bisect
from typing import Any

import torch
from torch import Tensor, nn

from zerotron.distributed.comm import Group
from zerotron.errors import ConfigError, DistributedError
from zerotron.precision.grads import weak_hook
from zerotron.zero.stage3.externals import (
    register_declared_externals,
    register_external_parameter,
    unwatch_parameters,
    watch_parameters,
)
from zerotron.zero.stage3.gather import (
    drop_ref,
    free,
    gather_now,
    make_available,
    start_fetches,
    take_ref,
)
from zerotron.zero.stage3.shards import (
    AVAILABLE,
    RELEASED,
    ShardStore,
    drop_stage3_attributes,
    is_partitioned,
    is_zero_param,
    partition_param,
    state_of,
)

LEAF_FLAG = "_z3_leaf"
"""Module attribute (DeepSpeed's name, set by ``set_z3_leaf_modules``): when True, the module's
forward gathers the parameters of its whole subtree at once, not module by module (for
sub-modules that run in a varying order or not at all, as the experts of an MoE layer)."""

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

    def done(self) -> int | None:
        """How many fetches of the recorded order this pass has made (None: no order yet, or
        the pass left it)."""
        return None if self.order is None or self.broken else self.pos

    def invalidate(self) -> None:
        self.order, self.recording, self.broken = None, None, True

    def end(self) -> None:
        if self.order is None and self.recording is not None:
            self.order = self.recording
        elif self.order is not None and not self.broken and self.pos != len(self.order):
            self.invalidate()  # the pass stopped early: the order is not what we recorded
        self.recording = None


class _ReusePlan:
    """Which parameters to keep gathered after a forward use (DeepSpeed's
    ``stage3_max_reuse_distance``).

    A step's fetches are the recorded forward order followed by the backward order. When a
    module's forward ends (after its children's fetches), each of its parameters stays gathered
    if its next use comes after fewer than ``max_distance`` parameter elements fetched in
    between; otherwise it is released as usual and gathered again. Uses after the backward are
    not planned: the optimizer step changes the shards, so everything is gathered afresh.
    """

    def __init__(self, fwd: list[nn.Module], bwd: list[nn.Module], fetch_list: Any):
        self.fwd, self.bwd = fwd, bwd
        self.ends = [0]  # ends[k]: elements fetched by the first k fetches of the step
        self.uses: dict[int, list[int]] = {}  # id(param) -> the fetches that use it
        for k, module in enumerate(fwd + bwd):
            params = fetch_list(module)
            self.ends.append(self.ends[-1] + sum(p.ds_numel for p in params))  # type: ignore[attr-defined]
            for p in params:
                self.uses.setdefault(id(p), []).append(k)

    def matches(self, fwd: list[nn.Module] | None, bwd: list[nn.Module] | None) -> bool:
        return fwd is self.fwd and bwd is self.bwd

    def kept(self, params: list[Tensor], done: int, max_distance: int) -> set[int]:
        """Ids of ``params`` to keep, released after the first ``done`` forward fetches."""
        out = set()
        for p in params:
            at = self.uses.get(id(p), [])
            j = bisect.bisect_left(at, done)  # the next use
            if j < len(at) and self.ends[at[j]] - self.ends[done] < max_distance:
                out.add(id(p))
        return out


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
        max_reuse_distance: int = 0,
        param_store: ShardStore | None = None,
    ):
        sizes = (
            prefetch_bucket_size or 0,
            max_live_parameters,
            persistence_threshold,
            max_reuse_distance,
        )
        if min(sizes) < 0:
            raise ConfigError(
                f"stage-3 sizes must be >= 0 (prefetch_bucket_size={prefetch_bucket_size}, "
                f"max_live_parameters={max_live_parameters}, "
                f"param_persistence_threshold={persistence_threshold}, "
                f"max_reuse_distance={max_reuse_distance})",
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
        self.max_reuse_distance = int(max_reuse_distance)
        """Keep a parameter gathered after a forward use when fewer elements than this are
        fetched before its next use; 0: release after every use."""
        self.param_store = param_store
        self.params: list[nn.Parameter] = []
        self.live_numel = 0
        self.peak_live_numel = 0  # the most elements gathered or in flight at once
        self.prefetches = 0  # modules whose gather started ahead of their use
        self._reuse_plan: _ReusePlan | None = None
        self._prefetched_numel = 0  # prefetched, not yet claimed by their module
        self._storage_owner: dict[int, Tensor] = {}  # gathered storage -> its parameter
        self._fwd_depth = 0
        self._fwd_modules: list[nn.Module] = []  # the forwards running now, innermost last
        self._saved_hooks: Any = None
        # Training forwards, no-grad forwards (evaluation, generation: a model may take other
        # paths there) and backwards each have their own order.
        self._traces = {"fwd": _Trace(), "eval": _Trace(), "bwd": _Trace()}
        self._fwd_trace = self._traces["fwd"]  # the current forward's
        self._bwd_task: int | None = None
        self._handles: list[Any] = []
        self._partition()
        register_declared_externals(module)
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
            if is_zero_param(p):  # partitioned earlier (zero.Init)
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
        st = state_of(p)
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
        st = state_of(p)
        st.coordinator = self
        self.params.append(p)
        if p.requires_grad:  # registered now, so it runs before the optimizer's hook
            self._handles.append(p.register_post_accumulate_grad_hook(weak_hook(self._after_grad)))

    def _install_hooks(self) -> None:
        # Bookkeeping and collectives, not tensor math: torch.compile runs them eagerly.
        pre, post = (
            torch.compiler.disable(self._pre_forward),
            torch.compiler.disable(self._post_forward),
        )
        for m in self.module.modules():
            self._handles.append(m.register_forward_pre_hook(pre, prepend=True))
            self._handles.append(m.register_forward_hook(post, always_call=True))
        watch_parameters(self.module, lambda m: any(map(is_partitioned, m._parameters.values())))
        self.module.__dict__["_zero3_coordinator"] = self

    def remove_hooks(self) -> None:
        """Detach from the module (parameters stay partitioned; see :meth:`unpartition`)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        unwatch_parameters(self.module)
        self.module.__dict__.pop("_zero3_coordinator", None)
        for p in self.params:
            state_of(p).coordinator = None

    def unpartition(self) -> None:
        """Make every parameter whole again on every rank and drop stage 3 (collective)."""
        self.release_all()
        full = [gather_now(p) for p in self.params]
        params = list(self.params)
        self.remove_hooks()
        for p, data in zip(params, full):
            p.data = data
            drop_stage3_attributes(p)
        for p in self.module.parameters():  # persistent ones: whole already
            drop_stage3_attributes(p)
        self.params.clear()

    # -- which parameters a module needs -------------------------------------------------------

    @staticmethod
    def _fetch_list(module: nn.Module) -> list[Tensor]:
        own = [p for p in module._parameters.values() if p is not None and is_partitioned(p)]
        if module.__dict__.get(LEAF_FLAG):  # a leaf module: its whole subtree, gathered at once
            mine = {id(p) for p in own}
            for sub in module.modules():
                for p in sub._parameters.values():
                    if p is not None and is_partitioned(p) and id(p) not in mine:
                        mine.add(id(p))
                        own.append(p)
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
            self._fwd_trace = self._traces["fwd" if torch.is_grad_enabled() else "eval"]
            self._fwd_trace.begin()
            # Saved views of gathered weights refer to the parameter, not its memory.
            self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._saved_hooks.__enter__()
        self._fwd_depth += 1
        params = self._fetch_list(module)
        # What this call holds, released as is after it (registrations may change meanwhile).
        module.__dict__.setdefault("_zero_fwd_held", []).append(params)
        self._fwd_modules.append(module)
        if params:
            upcoming = self._fwd_trace.step(module)
            for p in params:
                take_ref(p)
            self._claim_kept(params)
            make_available(params, lambda: self._prefetch(upcoming))

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        if torch._C._current_graph_task_id() != -1:
            return output  # recompute: the parameters stay for the backward that follows
        held = module.__dict__.get("_zero_fwd_held")
        if not held:  # the pre-hook failed before taking anything (the error propagates)
            return output
        params = held.pop()
        self._fwd_modules.pop()
        keep = self._kept_after(params) if torch.is_grad_enabled() else set()
        for p in params:
            st = state_of(p)
            if id(p) in keep and not st.reuse_hold:  # its ref stays, for the next use
                st.reuse_hold = True
            else:
                drop_ref(p)
        if torch.is_grad_enabled() and (params or self._fetch_list(module)):
            output = _wrap_outputs(output, _BackwardToken(self, module))
        self._fwd_depth -= 1
        if self._fwd_depth == 0:
            if self._saved_hooks is not None:
                self._saved_hooks.__exit__(None, None, None)
                self._saved_hooks = None
            self._fwd_trace.end()
            self._release_unclaimed()
        return output

    @torch.compiler.disable  # bookkeeping and a collective, as the hooks (run eagerly)
    def external_use(self, p: Tensor) -> None:
        """``p`` is read while not gathered (:class:`~zerotron.zero.stage3.externals.
        WatchedParameters`): inside a forward, gather it for the module running and register it
        with that module, so its later forwards and its backward gather it too."""
        if not self._fwd_modules or torch._C._current_graph_task_id() != -1:
            return  # outside a forward (or in a recompute, whose forward registered it)
        module = self._fwd_modules[-1]
        register_external_parameter(module, p)
        take_ref(p)
        module.__dict__["_zero_fwd_held"][-1].append(p)  # released after this forward
        make_available([p])

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
            st = state_of(p)
            if not st.bwd_hold:
                st.bwd_hold = True
                take_ref(p)
        self._claim_kept(params)
        make_available(params, prefetch)

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
            st = state_of(p)
            if st.bwd_hold:
                st.bwd_hold = False
                drop_ref(p)
        self.release_kept()
        self._release_unclaimed()

    def _after_grad(self, p: Tensor) -> None:
        st = state_of(p)
        if st.bwd_hold:
            st.bwd_hold = False
            drop_ref(p)

    # -- reuse ---------------------------------------------------------------------------------

    def _kept_after(self, params: list[Tensor]) -> set[int]:
        """Ids of those of ``params`` (a forward use that ends now) to keep gathered."""
        trace = self._traces["fwd"]
        done = trace.done() if self._fwd_trace is trace else None
        fwd, bwd = trace.order, self._traces["bwd"].order
        if not params or self.max_reuse_distance == 0 or done is None or bwd is None:
            return set()  # (the first step records the orders)
        plan = self._reuse_plan
        if plan is None or not plan.matches(fwd, bwd):
            plan = self._reuse_plan = _ReusePlan(fwd, bwd, self._fetch_list)  # type: ignore[arg-type]
        return plan.kept(params, done, self.max_reuse_distance)

    @staticmethod
    def _claim_kept(params: list[Tensor]) -> None:
        """The next use has taken its own ref: the reuse hold on ``params`` is no longer needed."""
        for p in params:
            st = state_of(p)
            if st.reuse_hold:
                st.reuse_hold = False
                drop_ref(p)

    def release_kept(self) -> None:
        """Release what forward uses kept gathered for a next use (the backward ended, or the
        optimizer is about to change the shards, which would make the gathered copies stale)."""
        self._claim_kept(self.params)

    # -- prefetch and accounting ---------------------------------------------------------------

    def _prefetch(self, upcoming: list[nn.Module]) -> None:
        """Start gathering the next modules' parameters within the prefetch budgets (without a
        ``prefetch_bucket_size``: the next module's, whatever its size)."""
        if self.prefetch_bucket_size is None:
            upcoming = upcoming[:1]
        for module in upcoming:
            todo = [p for p in self._fetch_list(module) if p.ds_status == RELEASED]
            if not todo:
                continue
            numel = sum(p.ds_numel for p in todo)  # type: ignore[attr-defined]
            bucket = self.prefetch_bucket_size
            if (
                bucket is not None and self._prefetched_numel + numel > bucket
            ) or self.live_numel + numel > self.max_live_parameters:
                return
            for p in todo:
                state_of(p).prefetched = True
            self._prefetched_numel += numel
            self.prefetches += 1
            start_fetches(todo)

    def _on_available(self, p: Tensor) -> None:
        self._storage_owner[p.data.untyped_storage().data_ptr()] = p
        self.peak_live_numel = max(self.peak_live_numel, self.live_numel)

    def _on_free(self, p: Tensor) -> None:
        self._storage_owner.pop(p.data.untyped_storage().data_ptr(), None)
        self.live_numel -= p.ds_numel  # type: ignore[attr-defined]
        if state_of(p).prefetched:
            self._prefetched_numel -= p.ds_numel  # type: ignore[attr-defined]

    def _release_unclaimed(self) -> None:
        """Free what was prefetched but never claimed (the pass went another way)."""
        for p in self.params:
            st = state_of(p)
            if st.refs == 0 and p.ds_status != RELEASED:
                free(p)

    def release_all(self) -> None:
        """Free every gathered parameter and forget all holds (after an error, say)."""
        for p in self.params:
            st = state_of(p)
            st.refs, st.bwd_hold, st.reuse_hold = 0, False, False
            free(p)

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
        if p.ds_status != AVAILABLE:  # used outside any module that fetches it
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


# --------------------------------------------------------------------------------------------
# Public functions


def partition_parameters(
    module: nn.Module,
    group: Group | None = None,
    *,
    persistence_threshold: int = int(1e5),
    prefetch_bucket_size: int | None = None,
    max_live_parameters: int = int(1e9),
    max_reuse_distance: int = 0,
    param_store: ShardStore | None = None,
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
        max_reuse_distance=max_reuse_distance,
        param_store=param_store,
    )


def coordinator_of(module: nn.Module) -> ParamCoordinator | None:
    """The coordinator :func:`partition_parameters` attached to ``module``, if any."""
    return module.__dict__.get("_zero3_coordinator")
