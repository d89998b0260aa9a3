"""--mock-data: the synthetic documents, the datasets over them, the flag (zerotron.data.mock).

The multi-rank proof (tp2, pp2, dp2 with ZeRO train as one process on mock data) is in
tests/distributed/test_equivalence_matrix.py.
"""

from __future__ import annotations

import contextlib
import io
import pickle

import numpy as np
import pytest
import torch

from zerotron.config import parse_megatron_args
from zerotron.data import index_builder as ib
from zerotron.data.mock import (
    MAX_DOCUMENT_LENGTH,
    NUM_DOCUMENTS,
    MockIndexedDataset,
    build_mock_datasets,
)
from zerotron.data.samplers import build_pretraining_data_loader
from zerotron.errors import ConfigError
from zerotron.training.pretrain import pretrain

GPT2_VOCAB, GPT2_EOD = 50257, 50256


def test_documents_are_deterministic_by_seed():
    a, b, c = (MockIndexedDataset(GPT2_VOCAB, GPT2_EOD, s) for s in (7, 7, 8))
    assert len(a) == a.num_documents == NUM_DOCUMENTS
    assert np.array_equal(a.sizes, b.sizes) and np.array_equal(a.starts, b.starts)
    assert all(np.array_equal(a.document(d), b.document(d)) for d in (0, 1, 99_999))
    assert not np.array_equal(a.sizes, c.sizes)


def test_document_lengths_follow_megatron_bounds():
    ds = MockIndexedDataset(GPT2_VOCAB, GPT2_EOD, 1)
    assert ds.sizes.min() >= 1 and ds.sizes.max() < MAX_DOCUMENT_LENGTH
    assert ds.num_tokens == int(ds.sizes.sum())
    assert np.array_equal(ds.doc_idx, np.arange(NUM_DOCUMENTS + 1))
    for d in (0, 5, 1234):
        assert len(ds.document(d)) == ds.sizes[d]


def test_tokens_count_up_through_a_tiny_vocabulary_and_end_in_eod():
    """Every id below the vocabulary, EOD only last, the count skipping EOD and wrapping."""
    vocab, eod = 7, 3
    ds = MockIndexedDataset(vocab, eod, 0, num_documents=50, max_length=40)
    for d in range(50):
        doc = ds.document(d)
        assert doc[-1] == eod and not (doc[:-1] == eod).any()
        assert doc.min() >= 0 and doc.max() < vocab
        body = doc[:-1]
        rank = body - (body > eod)  # position among the 6 non-EOD ids
        assert np.array_equal(rank, (ds.starts[d] + np.arange(len(body))) % (vocab - 1))


def test_get_is_a_slice_of_the_document():
    ds = MockIndexedDataset(100, 99, 3, num_documents=20, max_length=60)
    d = int(np.argmax(ds.sizes))
    whole = ds.document(d)
    assert np.array_equal(ds.get(d, 5, 10), whole[5:15])
    assert np.array_equal(ds.get(d, 5), whole[5:])
    assert np.array_equal(ds.get(d, len(whole) - 2, 10), whole[-2:])  # clipped at the end


def test_bad_vocabulary_is_refused():
    with pytest.raises(ConfigError, match="vocabulary of at least 2"):
        MockIndexedDataset(1, 0, 0)
    with pytest.raises(ConfigError, match="holding the EOD id"):
        MockIndexedDataset(10, 10, 0)


SEQ = 16


def _datasets(seed=5, counts=(40, 8, 4), split="80,10,10"):
    return build_mock_datasets(split, counts, SEQ, seed, vocab_size=GPT2_VOCAB, eod_token=GPT2_EOD)


def test_splits_hold_the_requested_samples_of_seq_length():
    train, valid, test = _datasets()
    assert (len(train), len(valid), len(test)) == (40, 8, 4)
    sample = train[3]
    assert sample["tokens"].shape == sample["labels"].shape == (SEQ,)
    assert sample["tokens"].dtype == torch.int64
    assert torch.equal(sample["loss_mask"], torch.ones(SEQ))
    raw = train.tokens(3)
    assert len(raw) == SEQ + 1
    assert torch.equal(sample["tokens"], torch.from_numpy(raw[:-1]))
    assert torch.equal(sample["labels"], torch.from_numpy(raw[1:]))
    assert int(raw.min()) >= 0 and int(raw.max()) < GPT2_VOCAB


def test_splits_draw_from_disjoint_documents():
    """--split divides the mock documents as it divides a corpus's."""
    datasets = _datasets()
    ranges = ib.split_ranges("80,10,10", NUM_DOCUMENTS)
    for ds, (lo, hi) in zip(datasets, ranges):
        assert lo <= int(ds.doc_idx.min()) and int(ds.doc_idx.max()) < hi
    assert _datasets(counts=(4, 0, 0))[1:] == (None, None)


def test_samples_are_deterministic_by_seed():
    a, b, c = _datasets(5)[0], _datasets(5)[0], _datasets(6)[0]
    assert all(torch.equal(a[i]["tokens"], b[i]["tokens"]) for i in range(len(a)))
    assert any(not torch.equal(a[i]["tokens"], c[i]["tokens"]) for i in range(len(a)))


def test_every_data_parallel_layout_reads_the_one_process_batches():
    """dp ranks' micro-batches, interleaved, are exactly the samples one process reads."""
    train = _datasets()[0]
    one = [b["tokens"] for b in build_pretraining_data_loader(train, 0, 4, 0, 1, 0)]
    ranks = [
        [b["tokens"] for b in build_pretraining_data_loader(train, 0, 2, r, 2, 0)] for r in (0, 1)
    ]
    for step, whole in enumerate(one):
        assert torch.equal(whole, torch.cat([ranks[0][step], ranks[1][step]]))


def test_pickles_whole_for_loader_workers():
    train = _datasets()[0]
    again = pickle.loads(pickle.dumps(train))
    assert all(torch.equal(train[i]["tokens"], again[i]["tokens"]) for i in range(len(train)))


TINY = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "2",
    "--train-iters", "3", "--lr", "1e-3", "--eval-iters", "1", "--eval-interval", "1000",
    "--log-interval", "1", "--num-workers", "0", "--split", "80,10,10",
]  # fmt: skip
NULL = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]  # ids 0..99, EOD 100


def test_mock_data_trains_without_data_path_on_a_vocab_size_vocabulary():
    """--mock-data needs no --data-path; Megatron's NullTokenizer --vocab-size sets the ids."""
    cfg = parse_megatron_args([*TINY, *NULL, "--mock-data"], world_size=1)
    assert cfg.data.mock_data and cfg.data.data_path is None and cfg.data.vocab_size == 100
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        summary = pretrain(cfg)
    assert sorted(summary.losses) == [1, 2, 3]
    assert all(np.isfinite(v) for v in summary.losses.values())
    assert " > padded vocab (size: 101) with 27 dummy tokens (new size: 128)" in out.getvalue()


def test_data_path_is_ignored_with_a_warning():
    """Megatron-LM builds the mock datasets and ignores --data-path; zerotron says so."""
    argv = [*TINY, *NULL, "--train-iters", "1", "--mock-data", "--data-path", "missing/prefix"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        summary = pretrain(parse_megatron_args(argv, world_size=1))
    assert sorted(summary.losses) == [1]
    assert " WARNING: --data-path is ignored with --mock-data" in out.getvalue()


def test_without_data_the_error_names_mock_data():
    argv = [*TINY, *NULL, "--train-iters", "1"]
    with pytest.raises(ConfigError, match="--mock-data"), contextlib.redirect_stdout(io.StringIO()):
        pretrain(parse_megatron_args(argv, world_size=1))


def test_vocab_size_belongs_to_null_tokenizer():
    with pytest.raises(ConfigError, match="NullTokenizer needs a vocabulary size"):
        parse_megatron_args([*TINY, "--tokenizer-type", "NullTokenizer"], world_size=1)
    with pytest.raises(ConfigError, match="--vocab-size is NullTokenizer's"):
        parse_megatron_args([*TINY, "--vocab-size", "100"], world_size=1)
