"""ZeRO stage 3, gathering: whole parameters assembled from every rank's shard.

One :class:`Fetch` is one ``all_gather`` of rank-major rows for several parameters (all of a
module's parameters in one collective). Gathers are reference-counted (:func:`take_ref`,
:func:`drop_ref`): a parameter is whole while anyone holds it (a module's forward, its
backward, a :class:`GatheredParameters` block) and freed when the last one lets go, so nesting
costs nothing. The coordinator (:mod:`~zerotron.zero.stage3.coordinator`) decides *when* to
gather; this module does the gathering, and the two user-facing gathers: a ``with`` block
(:class:`GatheredParameters`) and a whole state dict (:func:`gathered_state_dict`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from zerotron.distributed import comm
from zerotron.distributed.comm import Group, Pending
from zerotron.errors import DistributedError
from zerotron.zero.partition import BucketLayout, full_shape
from zerotron.zero.stage3.externals import register_external_parameter
from zerotron.zero.stage3.shards import (
    AVAILABLE,
    INFLIGHT,
    RELEASED,
    empty_like_param,
    gather_source,
    is_partitioned,
    state_of,
    write_full,
)

# --------------------------------------------------------------------------------------------
# Gathers: one all_gather of rank-major rows for several parameters


class Fetch:
    """One all_gather in flight for some parameters; :meth:`finish` installs their full data."""

    def __init__(self, params: list[Tensor], group: Group):
        self.params = params
        self.layout = BucketLayout([full_shape(p) for p in params], group.size, range(len(params)))
        shards = [gather_source(p) for p in params]
        row = shards[0] if len(shards) == 1 else torch.cat(shards)
        self.pending: Pending | None = comm.all_gather_async(row, group)
        # One parameter's rows are its chunks in order: the buffer is the parameter (no copy).
        # At size 1 the "gathered" buffer is the shard itself, which must not be aliased.
        self.in_place = len(params) == 1 and group.size > 1
        for p in params:
            st = state_of(p)
            p.ds_status, st.fetch = INFLIGHT, self  # type: ignore[attr-defined]
            if st.coordinator is not None:
                st.coordinator.live_numel += p.ds_numel  # type: ignore[attr-defined]

    def finish(self) -> None:
        if self.pending is None:
            return
        buf = self.pending.wait()
        self.pending = None
        if self.in_place:
            p = self.params[0]
            fulls = [buf.view(-1)[: p.ds_numel].view(full_shape(p))]  # type: ignore[attr-defined]
        else:
            fulls = self.layout.unpack(buf)  # new tensors (a copy out of the strided columns)
        for p, full in zip(self.params, fulls):
            st = state_of(p)
            p.data = full
            p.ds_status, st.fetch = AVAILABLE, None  # type: ignore[attr-defined]
            if st.coordinator is not None:
                st.coordinator._on_available(p)


def start_fetches(params: list[Tensor]) -> list[Fetch]:
    """Start gathering ``params`` (released ones): one collective per (group, dtype, device)."""
    by_key: dict[tuple, list[Tensor]] = {}
    for p in params:
        st = state_of(p)
        by_key.setdefault((st.group.name, st.group.ranks, p.dtype, p.device), []).append(p)
    return [Fetch(ps, state_of(ps[0]).group) for ps in by_key.values()]


def take_ref(p: Tensor) -> None:
    st = state_of(p)
    st.refs += 1
    if st.prefetched:  # claimed: no longer counts against the prefetch budget
        st.prefetched = False
        if st.coordinator is not None:
            st.coordinator._prefetched_numel -= p.ds_numel  # type: ignore[attr-defined]


def make_available(params: list[Tensor], prefetch: Any = None) -> None:
    """Gather those of ``params`` that are released (one collective), start ``prefetch()``
    meanwhile, and wait until all of ``params`` are there."""
    fetches = start_fetches([p for p in params if p.ds_status == RELEASED])  # type: ignore[attr-defined]
    if prefetch is not None:
        prefetch()
    for p in params:
        fetch = state_of(p).fetch
        if fetch is not None:
            fetch.finish()
    for f in fetches:
        f.finish()


def drop_ref(p: Tensor) -> None:
    st = state_of(p)
    st.refs -= 1
    if st.refs < 0:
        raise DistributedError(
            f"stage-3 parameter {st.key} released more often than gathered", where="zero.stage3"
        )
    if st.refs == 0:
        free(p)


def free(p: Tensor) -> None:
    """Drop the full data of ``p`` (finishing its collective first if one is in flight)."""
    st = state_of(p)
    if st.fetch is not None:
        st.fetch.finish()  # a collective cannot be abandoned half-way
    if p.ds_status == AVAILABLE:  # type: ignore[attr-defined]
        if st.coordinator is not None:
            st.coordinator._on_free(p)
        p.data = empty_like_param(p)
        p.ds_status = RELEASED  # type: ignore[attr-defined]
        st.prefetched = False


def gather_now(p: Tensor) -> Tensor:
    """The full parameter as a new tensor (one collective; ``p`` itself is not changed)."""
    st = state_of(p)
    if p.ds_status == AVAILABLE:  # type: ignore[attr-defined]
        return p.data.clone()
    layout = BucketLayout([full_shape(p)], st.group.size, [0])
    buf = comm.all_gather(gather_source(p), st.group)
    return layout.unpack(buf)[0]


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
        self.persistent = _unique(p for p in plist if getattr(p, "ds_persist", False))

    def __enter__(self) -> GatheredParameters:
        if self.enabled:
            for p in self.params:
                take_ref(p)
            make_available(self.params)
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
                drop_ref(p)

    def _broadcast_and_repartition(self, src: int) -> None:
        groups: dict[tuple, list[Tensor]] = {}
        for p in self.params + self.persistent:
            g = state_of(p).group
            groups.setdefault((g.name, g.ranks, p.dtype, p.device), []).append(p)
        for ps in groups.values():
            flat = torch.cat([p.data.reshape(-1) for p in ps])  # one broadcast per group
            comm.broadcast(flat, state_of(ps[0]).group, src)
            offset = 0
            with torch.no_grad():
                for p in ps:
                    n = p.numel()
                    p.data.copy_(flat[offset : offset + n].view_as(p.data))
                    offset += n
                    if is_partitioned(p):
                        write_full(p, p.data)
                    p.zero_modified = True


def _unique(params: Iterable[Tensor]) -> list[Tensor]:
    out: list[Tensor] = []
    for p in params:
        if all(p is not q for q in out):
            out.append(p)
    return out


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
        group = next((state_of(t).group for t in sd.values() if is_partitioned(t)), None)
    if group is None:
        from zerotron.distributed.state import state

        group = state().dp
    keep = group.rank == 0 or not rank0_only
    out: dict[str, Tensor] = {}
    for name, t in sd.items():
        full = gather_now(t) if isinstance(t, Tensor) and is_partitioned(t) else t
        if keep:
            out[name] = full.detach().to("cpu", copy=True) if isinstance(full, Tensor) else full
    return out if keep else None
