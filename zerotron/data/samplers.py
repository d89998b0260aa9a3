"""Pretraining batch sampler over data-parallel ranks, and the DataLoader built on it.

Samples are consumed in order, one global step of ``micro_batch_size * data_parallel_size``
samples at a time; data-parallel rank r takes the r-th contiguous slice of each step. The
dataset's own shuffle index does the shuffling, so the sampler only has to be exact: ranks
never share a sample and a run resumed from ``consumed_samples`` continues with the very next
global step (Megatron's ``MegatronPretrainingSampler``).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from zerotron.data.gpt_dataset import gpt_collate
from zerotron.errors import ConfigError


class MegatronPretrainingSampler:
    """Yields this rank's micro-batches (lists of sample indices) from ``consumed_samples`` on.

    Args:
        total_samples: length of the dataset.
        consumed_samples: samples already consumed by all ranks together (from a checkpoint).
        micro_batch_size: samples per micro-batch on one rank.
        data_parallel_rank, data_parallel_size: this rank's place among the data-parallel ranks.
        drop_last: drop a final incomplete global step; otherwise each rank gets its slice of
            it (possibly shorter, or nothing).
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        drop_last: bool = True,
    ):
        if total_samples <= 0:
            raise ConfigError(f"no samples to draw from (total_samples={total_samples})")
        if micro_batch_size <= 0 or data_parallel_size <= 0:
            raise ConfigError(
                "micro_batch_size and data_parallel_size must be positive, "
                f"got {micro_batch_size} and {data_parallel_size}"
            )
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ConfigError(
                f"data_parallel_rank {data_parallel_rank} is outside [0, {data_parallel_size})"
            )
        if not 0 <= consumed_samples <= total_samples:
            raise ConfigError(
                f"consumed_samples {consumed_samples} is outside [0, {total_samples}]",
                fix="the dataset is smaller than the checkpoint's progress: request at least "
                "as many training samples (iterations x global batch size) as before",
            )
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.drop_last = drop_last

    @property
    def step_size(self) -> int:
        """Samples in one step over all data-parallel ranks."""
        return self.micro_batch_size * self.data_parallel_size

    def __len__(self) -> int:
        """Micro-batches this rank yields."""
        left = self.total_samples - self.consumed_samples
        full, rest = divmod(left, self.step_size)
        if self.drop_last or rest == 0:
            return full
        return full + int(rest > self.data_parallel_rank * self.micro_batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        offset = self.data_parallel_rank * self.micro_batch_size
        for start in range(self.consumed_samples, self.total_samples, self.step_size):
            end = start + self.step_size
            if end > self.total_samples:
                if self.drop_last:
                    return
                mine = range(
                    start + offset, min(start + offset + self.micro_batch_size, self.total_samples)
                )
                if len(mine):
                    yield list(mine)
                return
            yield list(range(start + offset, start + offset + self.micro_batch_size))


def build_pretraining_data_loader(
    dataset: torch.utils.data.Dataset | None,
    consumed_samples: int,
    micro_batch_size: int,
    data_parallel_rank: int,
    data_parallel_size: int,
    num_workers: int = 0,
    *,
    drop_last: bool = True,
    pin_memory: bool = False,
) -> torch.utils.data.DataLoader | None:
    """A DataLoader that yields this rank's micro-batches (dicts of batched tensors).

    Returns None for a missing dataset (a split with no samples requested). Workers reopen the
    dataset's memory maps (datasets pickle by file name), so ``num_workers > 0`` costs no copy.
    """
    if dataset is None:
        return None
    sampler = MegatronPretrainingSampler(
        total_samples=len(dataset),
        consumed_samples=consumed_samples,
        micro_batch_size=micro_batch_size,
        data_parallel_rank=data_parallel_rank,
        data_parallel_size=data_parallel_size,
        drop_last=drop_last,
    )
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        collate_fn=gpt_collate,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
    )
