"""The rank grid: which global rank holds which (pipeline, data, tensor) coordinates.

A pure object, no processes needed: tests, the memory estimator and the autotuner reason about
layouts with it, and the process groups are built from :meth:`ProcessTopology.groups`.

World = pp × dp × tp. tp varies fastest, then dp, then pp (Megatron-LM's order)::

    rank = (pp_rank * dp + dp_rank) * tp + tp_rank

so the ranks of one tensor-parallel group are neighbours (one node, fast links) and a pipeline
stage is a contiguous block of dp × tp ranks. With dp=tp=pp=2: stage 0 is ranks 0-3, stage 1
ranks 4-7; the stage-0 DP groups are [0, 2] and [1, 3], its TP groups [0, 1] and [2, 3].

Context (cp) and expert (ep) parallel axes will slot into ``AXES`` (Megatron orders them
tp, cp, ep, dp, pp from fastest to slowest); every method here is written over ``AXES`` so
adding one is a change to the tuple and the constructor, not to the arithmetic.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple

from zerotron.errors import ConfigError, DistributedError

# Slowest-varying first; the rank is the mixed-radix number with these digits.
AXES: tuple[str, ...] = ("pp", "dp", "tp")

# Composite groups by name: the axes that vary inside one group.
#   mp: model parallel = every rank holding one replica of the model (same dp index).
#   embedding: handled separately (first and last stage only), see ProcessTopology.groups.
COMPOSITE_AXES: dict[str, tuple[str, ...]] = {"mp": ("pp", "tp")}

GROUP_NAMES: tuple[str, ...] = (*AXES, *COMPOSITE_AXES, "embedding")


class Coords(NamedTuple):
    """A rank's position on the grid (field order = ``AXES``, slowest first)."""

    pp: int
    dp: int
    tp: int


@dataclass(frozen=True)
class ProcessTopology:
    """The (pp, dp, tp) grid of ``tp * dp * pp`` ranks; see the module docstring for the order."""

    tp: int = 1
    dp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for axis in AXES:
            size = getattr(self, axis)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ConfigError(
                    f"{axis} size must be a positive integer, got {size!r}",
                    where="ProcessTopology",
                    fix=f"pass {axis}=1 or more",
                )

    @classmethod
    def from_world(cls, world_size: int, tp: int = 1, pp: int = 1) -> ProcessTopology:
        """The grid for ``world_size`` ranks; dp is what remains after tp × pp."""
        if world_size < 1 or tp < 1 or pp < 1 or world_size % (tp * pp) != 0:
            raise ConfigError(
                f"world size {world_size} is not divisible by tensor-parallel size {tp} × "
                f"pipeline-parallel size {pp} = {tp * pp}",
                where="--tensor-model-parallel-size / --pipeline-model-parallel-size",
                fix=f"launch a multiple of {tp * pp} processes, or choose tp and pp whose "
                f"product divides {world_size}",
            )
        return cls(tp=tp, dp=world_size // (tp * pp), pp=pp)

    @property
    def world_size(self) -> int:
        return self.tp * self.dp * self.pp

    def size(self, axis: str) -> int:
        """Number of ranks along ``axis`` (one of ``AXES``)."""
        _check_axis(axis, AXES)
        return getattr(self, axis)

    def coords(self, rank: int) -> Coords:
        """The (pp, dp, tp) coordinates of ``rank``."""
        self._check_rank(rank)
        digits = []
        for axis in reversed(AXES):  # peel off the fastest digit first
            rank, digit = divmod(rank, getattr(self, axis))
            digits.append(digit)
        return Coords(*reversed(digits))

    def rank(self, **coords: int) -> int:
        """The global rank at ``coords``, e.g. ``rank(pp=1, dp=0, tp=3)``; omitted axes are 0."""
        for axis in coords:
            _check_axis(axis, AXES)
        rank = 0
        for axis in AXES:
            index, size = coords.get(axis, 0), getattr(self, axis)
            if not 0 <= index < size:
                raise DistributedError(
                    f"{axis} index {index} is outside 0..{size - 1}", where=repr(self)
                )
            rank = rank * size + index
        return rank

    def groups(self, axis: str) -> list[list[int]]:
        """All groups of ``axis``: lists of ranks that differ only along it, each sorted.

        ``axis`` is one of ``tp``, ``dp``, ``pp``, ``mp`` (tensor × pipeline: the ranks sharing a
        dp index) or ``embedding`` (the first and the last pipeline stage's ranks that share dp
        and tp indices, which hold the tied word embedding; a single rank when pp == 1). Groups
        are ordered by their smallest rank; together they cover every rank exactly once.
        """
        _check_axis(axis, GROUP_NAMES)
        if axis == "embedding":
            stages = sorted({0, self.pp - 1})
            return [
                [self.rank(**{**fixed, "pp": s}) for s in stages]
                for fixed in self._product(("dp", "tp"))
            ]
        varying = COMPOSITE_AXES.get(axis, (axis,))
        fixed_axes = tuple(a for a in AXES if a not in varying)
        groups = [
            sorted(self.rank(**fixed, **inner) for inner in self._product(varying))
            for fixed in self._product(fixed_axes)
        ]
        return sorted(groups)

    def group_of(self, rank: int, axis: str) -> list[int]:
        """The group of ``axis`` that contains ``rank`` (empty for ``embedding`` off its stages)."""
        self._check_rank(rank)
        return next((g for g in self.groups(axis) if rank in g), [])

    def stage_ranks(self, stage: int) -> list[int]:
        """The dp × tp ranks of pipeline stage ``stage``, ascending."""
        return [self.rank(pp=stage, **c) for c in self._product(("dp", "tp"))]

    def _product(self, axes: tuple[str, ...]) -> list[dict[str, int]]:
        ranges = [range(getattr(self, a)) for a in axes]
        return [dict(zip(axes, idx)) for idx in itertools.product(*ranges)]

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise DistributedError(
                f"rank {rank} is outside 0..{self.world_size - 1}", where=repr(self)
            )


def _check_axis(axis: str, allowed: tuple[str, ...]) -> None:
    if axis not in allowed:
        raise ConfigError(f"unknown parallel axis {axis!r}", fix=f"use one of {', '.join(allowed)}")
