"""Pretraining sampler: disjoint micro-batches per data-parallel rank, exact resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from zerotron.data.gpt_dataset import GPTDataset, gpt_collate
from zerotron.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder
from zerotron.data.samplers import MegatronPretrainingSampler, build_pretraining_data_loader
from zerotron.errors import ConfigError


def reference_batches(total, consumed, mb, rank, dp, drop_last=True):
    """Megatron's sampler, literally: fill a global batch, hand out this rank's slice."""
    out, batch = [], []
    for idx in range(consumed, total):
        batch.append(idx)
        if len(batch) == mb * dp:
            out.append(batch[rank * mb : (rank + 1) * mb])
            batch = []
    if batch and not drop_last:
        mine = batch[rank * mb : (rank + 1) * mb]
        if mine:
            out.append(mine)
    return out


CASES = [(t, mb, dp) for t in (1, 7, 24, 25, 100) for mb in (1, 2, 3) for dp in (1, 2, 4)]


@pytest.mark.parametrize("drop_last", [True, False])
def test_matches_reference_and_ranks_are_disjoint(drop_last):
    for total, mb, dp in CASES:
        for consumed in sorted(c for c in {0, 1, mb * dp, total // 2, total} if c <= total):
            per_rank = []
            for rank in range(dp):
                s = MegatronPretrainingSampler(total, consumed, mb, rank, dp, drop_last)
                got = list(s)
                assert got == reference_batches(total, consumed, mb, rank, dp, drop_last)
                assert len(s) == len(got)
                per_rank.append([i for b in got for i in b])
            flat = [i for r in per_rank for i in r]
            assert len(flat) == len(set(flat)), (total, mb, dp, consumed)
            step = mb * dp
            served = (total - consumed) if not drop_last else (total - consumed) // step * step
            assert sorted(flat) == list(range(consumed, consumed + served))


def test_resume_continues_with_the_next_step():
    total, mb, dp = 103, 2, 3
    for rank in range(dp):
        full = list(MegatronPretrainingSampler(total, 0, mb, rank, dp))
        for steps_done in range(len(full) + 1):
            consumed = steps_done * mb * dp
            resumed = list(MegatronPretrainingSampler(total, consumed, mb, rank, dp))
            assert resumed == full[steps_done:]


@pytest.mark.parametrize(
    "args",
    [(0, 0, 1, 0, 1), (10, 11, 1, 0, 1), (10, 0, 0, 0, 1), (10, 0, 1, 2, 2), (10, 0, 1, -1, 2)],
)
def test_bad_arguments(args):
    with pytest.raises(ConfigError):
        MegatronPretrainingSampler(*args)


def _dataset(tmp_path, **kw):
    rng = np.random.default_rng(0)
    with MMapIndexedDatasetBuilder(tmp_path / "d", np.uint16) as b:
        for n in rng.integers(1, 40, 30):
            b.add_document(np.append(rng.integers(1, 1000, int(n)), 0))
    ds = MMapIndexedDataset(tmp_path / "d")
    return GPTDataset(ds, "train", range(30), 64, 16, 1, eod_token=0, **kw)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_data_loader_batches_equal_dataset_samples(tmp_path, num_workers):
    ds = _dataset(tmp_path, reset_attention_mask=True, reset_position_ids=True)
    consumed, mb, dp = 12, 2, 2
    for rank in range(dp):
        loader = build_pretraining_data_loader(ds, consumed, mb, rank, dp, num_workers)
        batches = list(loader)
        expect = reference_batches(len(ds), consumed, mb, rank, dp)
        assert len(batches) == len(expect) == len(loader)
        for batch, idx in zip(batches, expect):
            want = gpt_collate([ds[i] for i in idx])
            assert batch.keys() == want.keys()
            assert batch["attention_mask"].shape == (mb, 1, 16, 16)
            for key in want:
                assert torch.equal(batch[key], want[key]), key


def test_no_dataset_no_loader():
    assert build_pretraining_data_loader(None, 0, 1, 0, 1) is None
