"""The process groups of this rank: the one piece of global distributed state.

:func:`initialize_model_parallel` lays the world out on a :class:`ProcessTopology` (tp fastest,
then dp, then pp) and creates one torch process group per group of ranks that vary along
``tp``, ``dp``, ``pp``, ``mp`` (tp × pp: one model replica) and ``embedding`` (first and last
pipeline stage, which share the tied word embedding). :func:`state` returns the resulting
:class:`ParallelState`; every other module asks it, never torch, which group to talk to.

Without :func:`initialize_model_parallel`, :func:`state` describes plain data parallelism over
all ranks (tp = pp = 1, dp = world; one process: all sizes 1), which needs no extra groups.

Import the names from this module (``from zerotron.distributed.state import state``): the
package re-exports the function :func:`state` under the module's own name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from zerotron.distributed import init
from zerotron.distributed.comm import Group, world_group
from zerotron.distributed.topology import Coords, ProcessTopology
from zerotron.errors import ConfigError, DistributedError

# Creation order of the groups: every rank must call new_group for every group in this order.
GROUP_ORDER = ("tp", "dp", "pp", "mp", "embedding")


@dataclass(frozen=True)
class ParallelState:
    """This rank's place on the grid and its groups (``tp``, ``dp``, ``pp``, ``mp``,
    ``embedding``, ``world``, each a :class:`~zerotron.distributed.comm.Group`)."""

    topology: ProcessTopology
    rank: int
    tp: Group
    dp: Group
    pp: Group
    mp: Group
    embedding: Group
    world: Group
    virtual_pipeline_size: int | None = None
    # A process group holding only this rank, for code that passes torch groups around
    # (the mpu adapter): None stands for WORLD in torch.distributed, so a one-rank group must
    # be a real one there. None in a single-process run.
    self_pg: Any = field(default=None, repr=False, compare=False)

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def coords(self) -> Coords:
        return self.topology.coords(self.rank)

    @property
    def tp_rank(self) -> int:
        return self.coords.tp

    @property
    def dp_rank(self) -> int:
        return self.coords.dp

    @property
    def pp_rank(self) -> int:
        return self.coords.pp

    @property
    def tp_size(self) -> int:
        return self.topology.tp

    @property
    def dp_size(self) -> int:
        return self.topology.dp

    @property
    def pp_size(self) -> int:
        return self.topology.pp

    def group(self, name: str) -> Group:
        """The group called ``name`` (tp, dp, pp, mp, embedding or world)."""
        if name not in (*GROUP_ORDER, "world"):
            raise DistributedError(
                f"unknown group {name!r}", fix=f"use one of {', '.join(GROUP_ORDER)}, world"
            )
        return getattr(self, name)

    def is_first_stage(self, virtual_stage: int | None = None) -> bool:
        """First pipeline stage; with ``virtual_stage``, also its first model chunk."""
        return self.pp_rank == 0 and (virtual_stage is None or virtual_stage == 0)

    def is_last_stage(self, virtual_stage: int | None = None) -> bool:
        """Last pipeline stage; with ``virtual_stage``, also its last model chunk."""
        last_chunk = (self.virtual_pipeline_size or 1) - 1
        return self.pp_rank == self.pp_size - 1 and (
            virtual_stage is None or virtual_stage == last_chunk
        )

    @property
    def in_embedding_group(self) -> bool:
        """Whether this rank holds a copy of the tied word embedding (first or last stage)."""
        return self.embedding.is_member

    @property
    def next_stage_rank(self) -> int:
        """Global rank of the next pipeline stage (wrapping around), same dp and tp."""
        return self.pp.ranks[(self.pp_rank + 1) % self.pp_size]

    @property
    def prev_stage_rank(self) -> int:
        """Global rank of the previous pipeline stage (wrapping around), same dp and tp."""
        return self.pp.ranks[(self.pp_rank - 1) % self.pp_size]


_STATE: ParallelState | None = None


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
) -> ParallelState:
    """Create this rank's groups (collective: every rank calls it with the same sizes).

    The data-parallel size is what remains: world / (tp × pp); a world not divisible by tp × pp
    is a :class:`ConfigError` naming the numbers. Calling it again with the same sizes returns
    the existing state.
    """
    global _STATE
    world, rank = init.get_world_size(), init.get_rank()
    topo = ProcessTopology.from_world(
        world, tp=tensor_model_parallel_size, pp=pipeline_model_parallel_size
    )
    vpp = virtual_pipeline_model_parallel_size
    if vpp is not None:
        if isinstance(vpp, bool) or not isinstance(vpp, int) or vpp < 1:
            raise ConfigError(
                f"virtual pipeline size must be a positive integer, got {vpp!r}",
                where="--virtual-pipeline-model-parallel-size",
            )
        if vpp > 1 and topo.pp == 1:
            raise ConfigError(
                f"virtual pipeline size {vpp} needs pipeline-parallel size > 1",
                where="--num-layers-per-virtual-pipeline-stage",
                fix="set --pipeline-model-parallel-size 2 or more, or drop the virtual stages",
            )
    if _STATE is not None:
        if (_STATE.topology, _STATE.virtual_pipeline_size) == (topo, vpp):
            return _STATE
        raise DistributedError(
            f"model parallel groups already exist for {_STATE.topology} "
            f"(virtual {_STATE.virtual_pipeline_size}); asked for {topo} (virtual {vpp})",
            where="initialize_model_parallel",
            fix="call destroy_model_parallel() first",
        )
    groups = {name: _build_group(name, topo, rank) for name in GROUP_ORDER}
    self_pg = _build_self_pg(world, rank)
    _STATE = ParallelState(
        topology=topo,
        rank=rank,
        world=world_group(),
        virtual_pipeline_size=vpp,
        self_pg=self_pg,
        **groups,
    )
    return _STATE


def state() -> ParallelState:
    """The current :class:`ParallelState` (plain data parallelism if none was initialized)."""
    if _STATE is not None:
        return _STATE
    world, rank = init.get_world_size(), init.get_rank()
    everyone = world_group()
    single = {name: Group.single(name, rank) for name in ("tp", "pp", "mp", "embedding")}
    return ParallelState(
        topology=ProcessTopology(dp=world),
        rank=rank,
        dp=Group("dp", everyone.ranks, everyone.rank, everyone.pg),
        world=everyone,
        **single,
    )


def group_of(pg: Any) -> Group:
    """The :class:`Group` that a torch ProcessGroup is, for code that passes torch groups.

    ``None`` (torch's "the default group") and the default group itself are the ``world``
    group; one of this rank's groups (``tp``, ``dp``, ...) is that group, under its name, so
    the ledger names it; any other group is named after its ranks (``group[0,2]``). A group
    this rank is not in (``new_group`` returns a placeholder there) has no ranks and
    ``is_member`` False.
    """
    if pg is None or pg is dist.group.WORLD:
        return world_group()
    if isinstance(pg, int) and pg == dist.GroupMember.NON_GROUP_MEMBER:
        return Group("non-member", (), -1, None)
    if _STATE is not None:
        for name in GROUP_ORDER:
            mine = _STATE.group(name)
            if mine.pg is pg:
                return mine
    ranks = tuple(dist.get_process_group_ranks(pg))
    me = init.get_rank()
    name = f"group[{','.join(map(str, ranks))}]"
    return Group(name, ranks, ranks.index(me) if me in ranks else -1, pg)


def is_model_parallel_initialized() -> bool:
    """Whether :func:`initialize_model_parallel` has run (and not been destroyed)."""
    return _STATE is not None


def destroy_model_parallel() -> None:
    """Destroy the groups :func:`initialize_model_parallel` created; :func:`state` resets."""
    global _STATE
    if _STATE is None:
        return
    current, _STATE = _STATE, None
    if not init.is_initialized():
        return
    pgs = [current.group(n).pg for n in GROUP_ORDER] + [current.self_pg]
    for pg in pgs:
        if pg is not None:
            dist.destroy_process_group(pg)


def _build_group(name: str, topo: ProcessTopology, rank: int) -> Group:
    mine = Group(name, (), -1, None)
    for ranks in topo.groups(name):
        # One-rank groups need no process group: comm never calls torch for them. Every rank
        # makes the same choice from the same topology, so new_group calls stay in step.
        pg = init.new_group(ranks) if len(ranks) > 1 else None
        if rank in ranks:
            mine = Group(name, tuple(ranks), ranks.index(rank), pg)
    return mine


def _build_self_pg(world: int, rank: int) -> Any:
    if world == 1:
        return None
    mine = None
    for r in range(world):
        pg = init.new_group([r])
        if r == rank:
            mine = pg
    return mine
