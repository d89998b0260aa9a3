"""The groups collectives run over: :class:`Group`, one process group as this rank sees it, and
:func:`world_group`, all ranks. Built by :mod:`zerotron.distributed.state`; every call of
:mod:`zerotron.distributed.comm` takes one (which re-exports both names)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


@dataclass(frozen=True)
class Group:
    """One process group as this rank sees it.

    ``ranks`` are global ranks in group order; ``rank`` is this process's index in them (-1 when
    it is not a member, e.g. a middle pipeline stage and the embedding group). ``pg`` is the
    torch ProcessGroup, or None when the group has one rank (or the run has one process): then
    every collective here returns at once.
    """

    name: str
    ranks: tuple[int, ...]
    rank: int
    pg: Any = None

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def is_member(self) -> bool:
        return self.rank >= 0

    def global_rank(self, index: int) -> int:
        """The global rank of the group's ``index``-th member."""
        return self.ranks[index]

    @classmethod
    def single(cls, name: str, rank: int = 0) -> Group:
        """A one-rank group holding global ``rank``: every collective on it is a no-op."""
        return cls(name, (rank,), 0, None)

    def __repr__(self) -> str:
        return f"Group({self.name}, ranks={list(self.ranks)}, rank={self.rank})"


def world_group() -> Group:
    """All ranks (a one-rank group when no process group is initialized)."""
    if not (dist.is_available() and dist.is_initialized()):
        return Group.single("world")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world == 1:
        return Group.single("world")
    return Group("world", tuple(range(world)), rank, dist.group.WORLD)
