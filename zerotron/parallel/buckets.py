"""Gradient buckets: parameters whose gradients are reduced by one collective, launched in order.

Data parallelism (:mod:`zerotron.parallel.data_parallel`: an all-reduce of a flat fp32 buffer)
and ZeRO (:mod:`zerotron.zero.grads`: a reduce-scatter of rank-major rows into partitions)
reduce gradients differently but schedule them the same way, which is this module:

- **Grouping** (:func:`group_into_buckets`). Parameters are taken in a given order (reversed
  registration order: roughly the order backward produces their gradients); a bucket closes
  once it holds at least ``bucket_size`` elements (a parameter larger than that gets a bucket of
  its own) and whenever the key (dtype, device: one buffer per bucket) changes.
- **Launching** (:class:`GradBuckets`). Each parameter's gradient hook reports it ready
  (:meth:`GradBuckets.grad_ready`); a bucket whose gradients are all in is launched at once
  (asynchronously, while backward goes on) but only in bucket order, so every rank issues the
  same collectives in the same order even if hooks fire in a different order.
  :meth:`GradBuckets.flush` launches what backward did not complete (unused parameters) and
  finishes every collective in bucket order.

What a launch and a finish do (pack, which collective, averaging, unpack) is the owner's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Generic, TypeVar

import torch
from torch import nn

from zerotron.distributed.comm import Pending


def group_into_buckets(
    numels: Sequence[int],
    bucket_size: int,
    order: Iterable[int],
    key: Callable[[int], object] | None = None,
) -> list[list[int]]:
    """Indices into ``numels`` grouped into buckets (see the module docstring), taken in
    ``order``. ``bucket_size`` must be positive (the callers name their own config key)."""
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i in order:
        if current and key is not None and key(current[0]) != key(i):
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += numels[i]
        if size >= bucket_size:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


class GradBucket:
    """One bucket's parameters, its wire dtype, the gradients counted in, its collective."""

    def __init__(self, index: int, params: list[nn.Parameter], wire: torch.dtype):
        self.index = index
        self.params = params
        self.wire = wire
        self.ready = 0  # parameters whose gradient this backward has produced
        self.pending: Pending | None = None


B = TypeVar("B", bound=GradBucket)


class GradBuckets(Generic[B]):
    """Launches ``buckets`` in bucket order as their gradients come in (module docstring).

    Args:
        buckets: in launch order.
        launch: starts a bucket's collective (sets ``bucket.pending``; it may finish it at once).
        finish: waits for a launched bucket and uses the result (clears ``bucket.pending``).
    """

    def __init__(
        self, buckets: Sequence[B], launch: Callable[[B], None], finish: Callable[[B], None]
    ):
        self.buckets = list(buckets)
        self._launch = launch
        self._finish = finish
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._next_launch = 0

    def __iter__(self) -> Iterator[B]:
        return iter(self.buckets)

    def __len__(self) -> int:
        return len(self.buckets)

    def bucket_of(self, param: torch.Tensor) -> B:
        return self._bucket_of[id(param)]

    def grad_ready(self, param: torch.Tensor) -> None:
        """``param``'s gradient is in: launch, in bucket order, every bucket now complete."""
        bucket = self._bucket_of[id(param)]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if bucket.ready < len(bucket.params):
                return
            self._launch(bucket)
            self._next_launch += 1

    def flush(self) -> None:
        """Launch every bucket not launched yet, then finish all in bucket order and start
        counting afresh. Every rank must call it at the same point."""
        for bucket in self.buckets[self._next_launch :]:
            self._launch(bucket)
        for bucket in self.buckets:
            if bucket.pending is not None:
                self._finish(bucket)
            bucket.ready = 0
        self._next_launch = 0

    def in_flight(self) -> bool:
        """Whether some bucket's collective is launched and not finished."""
        return any(b.pending is not None for b in self.buckets)
