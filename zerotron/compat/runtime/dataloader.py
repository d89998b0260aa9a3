"""DeepSpeed's ``deepspeed.runtime.dataloader``: :class:`RepeatingLoader`."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any


class RepeatingLoader:
    """Iterate ``loader`` forever: when it is exhausted, start it again (a new ``iter``, so a
    DataLoader's sampler reshuffles if it does so per epoch, e.g. after ``set_epoch``).

    The usual companion of ``engine.train_batch(data_iter=...)``, which pulls micro-batches for
    as many steps as the script runs.
    """

    def __init__(self, loader: Iterable[Any]):
        self.loader = loader
        self.data_iter: Iterator[Any] = iter(loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)  # an empty loader ends the iteration here
