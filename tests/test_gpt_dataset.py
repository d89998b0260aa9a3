"""GPT datasets: splits, sample coverage per epoch, caches, masks, blends, dataset-info."""

from __future__ import annotations

import os
import pickle
import re
from fractions import Fraction

import numpy as np
import pytest
import torch

from zerotron.data import index_builder as ib
from zerotron.data.blended_dataset import BlendedDataset
from zerotron.data.gpt_dataset import (
    GPTDataset,
    build_train_valid_test_datasets,
    document_sizes,
    gpt_collate,
    parse_data_path,
)
from zerotron.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder
from zerotron.errors import ConfigError, DataError

EOD = 0


def write_corpus(prefix, docs, *, split_sequences=False, dtype=np.int32):
    """Write documents (lists of token arrays); optionally cut each into several sequences."""
    rng = np.random.default_rng(7)
    with MMapIndexedDatasetBuilder(prefix, dtype) as b:
        for doc in docs:
            doc = np.asarray(doc)
            if split_sequences and len(doc) > 2 and rng.random() < 0.5:
                cut = sorted(rng.choice(np.arange(1, len(doc)), size=2, replace=False).tolist())
                b.add_document(doc, [cut[0], cut[1] - cut[0], len(doc) - cut[1]])
            else:
                b.add_document(doc)
    return str(prefix)


def unique_docs(lengths, start=1):
    """Documents whose tokens are all distinct integers, so every token names its position."""
    docs, t = [], start
    for n in lengths:
        docs.append(np.arange(t, t + n))
        t += n
    return docs


def reference_split(split: str, n: int) -> list[tuple[int, int]]:
    """Megatron's train/valid/test document split, written out step by step."""
    sep = "," if "," in split else "/"
    shares = [float(x) for x in split.split(sep)] + [0.0, 0.0]
    shares = shares[:3]
    total = sum(shares)
    bounds = [0]
    for sh in shares:
        bounds.append(bounds[-1] + int(round(sh / total * n)))
    excess = bounds[-1] - n
    bounds = [0] + [b - excess for b in bounds[1:]]
    return list(zip(bounds[:-1], bounds[1:]))


# --------------------------------------------------------------------------- splits


@pytest.mark.parametrize(
    "split", ["949,50,1", "98,2,0", "98/2/0", "80,10,10", "1", "7, 3", "1,1,1"]
)
def test_split_ranges_match_megatron(split):
    for n in [0, 1, 2, 3, 5, 10, 99, 270, 1001, 123457]:
        assert ib.split_ranges(split, n) == reference_split(split.replace(" ", ""), n)


@pytest.mark.parametrize("bad", ["", "a,b", "-1,2,3", "0,0,0", "1,2,3,4"])
def test_bad_split_is_config_error(bad):
    with pytest.raises(ConfigError):
        ib.parse_split(bad)


def test_empty_split_error_names_split_and_suggests_one(tmp_path):
    prefix = write_corpus(tmp_path / "tiny", unique_docs([10, 12, 9]))
    with pytest.raises(DataError) as e:
        build_train_valid_test_datasets(
            [prefix], "949,50,1", (10, 5, 0), 4, 1, eod_token=EOD, cache_dir=tmp_path
        )
    msg = str(e.value)
    assert "valid split has 0 of 3 documents with --split 949,50,1" in msg
    suggested = re.search(r"use --split (\S+) or add data", msg).group(1)
    train, valid, _ = build_train_valid_test_datasets(
        [prefix], suggested, (10, 5, 0), 4, 1, eod_token=EOD, cache_dir=tmp_path
    )
    assert len(train) == 10 and len(valid) == 5


def test_too_few_documents_says_add_data(tmp_path):
    prefix = write_corpus(tmp_path / "one", unique_docs([10]))
    with pytest.raises(DataError, match="test split has 0 of 1 documents.*\n.*add data"):
        build_train_valid_test_datasets(
            [prefix], "100,0,0", (4, 0, 4), 4, 1, eod_token=EOD, cache_dir=tmp_path
        )


def test_missing_prefix_is_data_error(tmp_path):
    with pytest.raises(DataError, match="file not found"):
        build_train_valid_test_datasets(
            [str(tmp_path / "nope")], "1", (1, 0, 0), 4, 1, eod_token=EOD
        )


# --------------------------------------------------------------------------- coverage


def test_every_train_token_once_per_epoch(tmp_path):
    rng = np.random.default_rng(0)
    s = 16
    lengths = rng.integers(0, 40, size=60).tolist()  # includes empty documents
    lo, hi = ib.split_ranges("80,10,10", len(lengths))[0]
    # Make the train split's token count a multiple of s: epochs then end on sample boundaries.
    lengths[hi - 1] += (-sum(lengths[lo:hi])) % s
    docs = unique_docs(lengths)
    prefix = write_corpus(tmp_path / "c", docs, split_sequences=True)
    train_tokens = np.concatenate(docs[lo:hi])
    per_epoch = len(train_tokens) // s
    num_samples = 3 * per_epoch + per_epoch // 2
    train, _, _ = build_train_valid_test_datasets(
        [prefix], "80,10,10", (num_samples, 0, 0), s, 1234, eod_token=EOD, cache_dir=tmp_path
    )
    where = {int(t): (d, i) for d, doc in enumerate(docs) for i, t in enumerate(doc)}
    served = [train[i]["tokens"].numpy() for i in range(num_samples)]
    for e in range(3):
        inputs = np.concatenate(served[e * per_epoch : (e + 1) * per_epoch])
        assert np.array_equal(np.sort(inputs), np.sort(train_tokens)), f"epoch {e}"
    partial = np.concatenate(served[3 * per_epoch :])
    assert len(np.unique(partial)) == len(partial)  # a partial epoch repeats nothing
    for i in range(num_samples):
        sample = train.tokens(i)
        assert len(sample) == s + 1
        assert np.array_equal(served[i], sample[:-1])
        assert np.array_equal(train[i]["labels"].numpy(), sample[1:])
        for a, b in zip(sample[:-1], sample[1:]):
            (da, ia), (db, ib_) = where[int(a)], where[int(b)]
            # Inside a document tokens follow each other; a jump leaves a document at its end
            # and enters the next one at its start.
            assert (da == db and ib_ == ia + 1) or (ia == len(docs[da]) - 1 and ib_ == 0)


def test_epochs_not_aligned_to_samples(tmp_path):
    docs = unique_docs([7, 11, 5, 13, 9])
    prefix = write_corpus(tmp_path / "c", docs)
    s, total = 8, 45
    num_samples = 40  # 320 input tokens: 7.1 epochs
    (train, *_) = build_train_valid_test_datasets(
        [prefix], "1,0,0", (num_samples, 0, 0), s, 3, eod_token=EOD, cache_dir=tmp_path
    )
    inputs = np.concatenate([train[i]["tokens"].numpy() for i in range(num_samples)])
    counts = np.bincount(inputs, minlength=total + 1)[1:]
    full = num_samples * s // total
    assert counts.sum() == num_samples * s
    assert set(counts.tolist()) <= {full, full + 1}
    # Samples whose first token lies in epoch 0 are served first and cover all of it.
    first_block = -(-total // s)
    head = np.concatenate([train[i]["tokens"].numpy() for i in range(first_block)])
    assert len(np.unique(head)) == total and len(head) == first_block * s


def test_tiny_corpus_serves_every_requested_sample(tmp_path):
    from zerotron.data.samplers import build_pretraining_data_loader

    prefix = write_corpus(tmp_path / "tiny", unique_docs([5, 3, 7]))
    (train, *_) = build_train_valid_test_datasets(
        [prefix], "100,0,0", (600, 0, 0), 32, 5, eod_token=EOD, cache_dir=tmp_path
    )
    assert len(train) == 600
    loader = build_pretraining_data_loader(train, 0, 4, 0, 1)
    batches = list(loader)
    assert len(batches) == 150
    assert all(b["tokens"].shape == (4, 32) for b in batches)
    inputs = torch.cat([b["tokens"].reshape(-1) for b in batches]).numpy()
    counts = np.bincount(inputs, minlength=16)[1:]
    assert set(counts.tolist()) <= {600 * 32 // 15, 600 * 32 // 15 + 1}


def test_doc_idx_is_one_permutation_per_epoch(tmp_path):
    lengths = list(range(1, 31))
    prefix = write_corpus(tmp_path / "c", unique_docs(lengths))
    (train, *_) = build_train_valid_test_datasets(
        [prefix], "1,0,0", (100, 0, 0), 20, 9, eod_token=EOD, cache_dir=tmp_path
    )
    doc_idx = np.asarray(train.doc_idx)
    full = len(doc_idx) // 30
    assert full >= 3
    for e in range(full):
        assert sorted(doc_idx[e * 30 : (e + 1) * 30].tolist()) == list(range(30))
    assert len(set(doc_idx[full * 30 :].tolist())) == len(doc_idx) - full * 30
    assert not np.array_equal(doc_idx[:30], doc_idx[30:60])  # epochs are shuffled apart


def test_document_sizes_with_multi_sequence_documents(tmp_path):
    docs = unique_docs([5, 0, 9, 4, 12])
    prefix = write_corpus(tmp_path / "m", docs, split_sequences=True)
    ds = MMapIndexedDataset(prefix)
    assert len(ds) > ds.num_documents  # some documents really are several sequences
    assert document_sizes(ds).tolist() == [5, 0, 9, 4, 12]


# --------------------------------------------------------------------------- determinism, cache


def _all_tokens(ds):
    return np.stack([ds.tokens(i) for i in range(len(ds))])


def test_seed_determines_order(tmp_path):
    docs = unique_docs(np.random.default_rng(1).integers(1, 30, 40).tolist())
    prefix = write_corpus(tmp_path / "c", docs)
    kw = dict(eod_token=EOD)
    a = GPTDataset(
        MMapIndexedDataset(prefix), "train", range(40), 200, 8, 42, **kw, cache_dir=tmp_path / "a"
    )
    b = GPTDataset(
        MMapIndexedDataset(prefix), "train", range(40), 200, 8, 42, **kw, cache_dir=tmp_path / "b"
    )
    c = GPTDataset(
        MMapIndexedDataset(prefix), "train", range(40), 200, 8, 43, **kw, cache_dir=tmp_path / "c"
    )
    assert not a.cache_hit and not b.cache_hit
    assert np.array_equal(_all_tokens(a), _all_tokens(b))
    assert not np.array_equal(_all_tokens(a), _all_tokens(c))
    assert sorted(map(tuple, _all_tokens(a)[:10])) != sorted(map(tuple, _all_tokens(c)[:10]))


def test_seed_shuffles_samples_of_one_document(tmp_path):
    # With one document only the sample shuffle can differ between seeds.
    prefix = write_corpus(tmp_path / "one", unique_docs([400]))
    orders = [
        _all_tokens(
            GPTDataset(MMapIndexedDataset(prefix), "train", range(1), 40, 8, seed, eod_token=EOD)
        )[:, 0].tolist()
        for seed in (5, 6)
    ]
    assert orders[0] != orders[1] and sorted(orders[0]) == sorted(orders[1])


def _cache_files(d):
    return {f for f in os.listdir(d) if f.endswith((".npy", ".json"))}


def test_cache_is_reused_and_keyed_by_everything(tmp_path, monkeypatch):
    docs = unique_docs(np.random.default_rng(2).integers(1, 30, 50).tolist())
    prefix = write_corpus(tmp_path / "c", docs)
    other = write_corpus(tmp_path / "d", unique_docs([3] * 50))
    cache = tmp_path / "cache"

    def build(data=prefix, split="90,10,0", n=(100, 10, 0), s=8, seed=1, **kw):
        return build_train_valid_test_datasets(
            [data], split, n, s, seed, eod_token=EOD, cache_dir=cache, **kw
        )

    first = build()
    files = _cache_files(cache)
    assert len(files) == 8 and not first[0].cache_hit
    mtimes = {f: os.stat(cache / f).st_mtime_ns for f in files}

    def fail(*args, **kwargs):
        raise AssertionError("rebuilt an index that is cached")

    monkeypatch.setattr(ib, "build_gpt_indices", fail)
    again = build(eod_mask_loss=True, reset_position_ids=True)  # masks do not change indices
    assert again[0].cache_hit and again[1].cache_hit
    assert _cache_files(cache) == files
    assert {f: os.stat(cache / f).st_mtime_ns for f in files} == mtimes
    assert np.array_equal(_all_tokens(first[0]), _all_tokens(again[0]))
    monkeypatch.undo()

    seen = set(files)
    for change in [
        dict(n=(101, 10, 0)),
        dict(s=9),
        dict(seed=2),
        dict(split="80,20,0"),
        dict(data=other),
    ]:
        train, *_ = build(**change)
        assert not train.cache_hit, change
        new = _cache_files(cache) - seen
        assert any("_train_" in f for f in new), change
        seen |= new


def test_non_builder_waits_for_builder(tmp_path):
    prefix = write_corpus(tmp_path / "c", unique_docs([10] * 20))
    ds = MMapIndexedDataset(prefix)
    args = (ds, "train", range(20), 30, 8, 1)
    with pytest.raises(DataError, match="index cache not found"):
        GPTDataset(*args, eod_token=EOD, is_builder=False, barrier=lambda: None)
    built = []

    def barrier():  # rank 0 finishes building while the other rank waits here
        built.append(GPTDataset(*args, eod_token=EOD, is_builder=True))

    follower = GPTDataset(*args, eod_token=EOD, is_builder=False, barrier=barrier)
    assert follower.cache_hit and len(built) == 1
    assert np.array_equal(_all_tokens(follower), _all_tokens(built[0]))


def test_pickle_reopens_memory_maps(tmp_path):
    prefix = write_corpus(tmp_path / "c", unique_docs([10] * 20))
    ds = GPTDataset(MMapIndexedDataset(prefix), "train", range(20), 30, 8, 1, eod_token=EOD)
    blob = pickle.dumps(ds)
    assert len(blob) < 4000  # file names, not arrays
    back = pickle.loads(blob)
    assert np.array_equal(_all_tokens(back), _all_tokens(ds))


# --------------------------------------------------------------------------- masks


def reference_masks(tokens, eod, eod_mask_loss, reset_position_ids, reset_attention_mask):
    """Megatron's loop: mask rows after each EOD, shift positions after each EOD."""
    s = len(tokens)
    mask = np.tril(np.ones((s, s), bool))
    loss = np.ones(s, np.float32)
    if eod_mask_loss:
        loss[tokens == eod] = 0
    pos = np.arange(s)
    prev = 0
    for i in np.nonzero(tokens == eod)[0]:
        if reset_attention_mask:
            mask[i + 1 :, : i + 1] = False
        if reset_position_ids:
            pos[i + 1 :] -= i + 1 - prev
            prev = i + 1
    return loss, pos, mask[None]


@pytest.mark.parametrize("flags", [(0, 0, 0), (1, 0, 0), (0, 1, 0), (0, 0, 1), (1, 1, 1)])
def test_masks_match_megatron_reference(tmp_path, flags):
    eod_mask_loss, reset_pos, reset_attn = map(bool, flags)
    rng = np.random.default_rng(3)
    docs = [np.append(rng.integers(1, 50, int(n)), EOD) for n in rng.integers(0, 12, 40)]
    docs.append(np.array([EOD, EOD, 5]))  # EODs back to back
    prefix = write_corpus(tmp_path / "m", docs)
    ds = GPTDataset(
        MMapIndexedDataset(prefix),
        "train",
        range(len(docs)),
        50,
        24,
        0,
        eod_token=EOD,
        eod_mask_loss=eod_mask_loss,
        reset_position_ids=reset_pos,
        reset_attention_mask=reset_attn,
    )
    for i in range(len(ds)):
        sample = ds[i]
        tokens = sample["tokens"].numpy()
        loss, pos, mask = reference_masks(tokens, EOD, eod_mask_loss, reset_pos, reset_attn)
        assert sample["tokens"].dtype == torch.int64 and sample["labels"].dtype == torch.int64
        assert sample["loss_mask"].dtype == torch.float32
        assert np.array_equal(sample["loss_mask"].numpy(), loss)
        assert np.array_equal(sample["position_ids"].numpy(), pos)
        if reset_attn:
            assert sample["attention_mask"].dtype == torch.bool
            assert np.array_equal(sample["attention_mask"].numpy(), mask)
        else:
            assert "attention_mask" not in sample
    batch = gpt_collate([ds[0], ds[1], ds[2]])
    assert batch["tokens"].shape == (3, 24)
    if reset_attn:
        assert batch["attention_mask"].shape == (3, 1, 24, 24)


# --------------------------------------------------------------------------- blends


def reference_blend(weights, size):
    """Tijdeman's earliest-deadline rule in exact rational arithmetic."""
    w = [Fraction(x) / sum(map(Fraction, weights)) for x in weights]
    k = len(w)
    sigma = Fraction(1, 2 * k - 2) if k > 1 else Fraction(0)
    counts, out = [0] * k, []
    for t in range(1, size + 1):
        ready = [d for d in range(k) if w[d] * t - counts[d] >= sigma]
        d = min(ready, key=lambda d: ((counts[d] + 1 - sigma) / w[d], d))
        out.append(d)
        counts[d] += 1
    return out


@pytest.mark.parametrize("k", [2, 3, 4, 7])
def test_blend_counts_within_one_sample_of_weights(k):
    rng = np.random.default_rng(k)
    for trial in range(4):
        weights = rng.random(k) ** 3 + 1e-3
        size = 2000
        index, sample = ib.build_blending_indices(weights.tolist(), size)
        w = weights / weights.sum()
        counts = np.cumsum(np.eye(k, dtype=np.int64)[index], axis=0)
        n = np.arange(1, size + 1)[:, None]
        assert np.abs(counts - w * n).max() < 1.0, (weights, trial)
        for d in range(k):  # the j-th pick of a dataset serves its sample j
            assert sample[index == d].tolist() == list(range(int((index == d).sum())))
        if trial == 0:
            assert index[:400].tolist() == reference_blend(weights.tolist(), 400)


def test_two_dataset_blend_fast_path_equals_loop():
    for weights in ([0.3, 0.7], [0.5, 0.5], [1, 3], [0.999, 0.001], [0.123456, 0.654321]):
        w = ib.normalize_weights(weights)
        fast = ib._blend_two(w, 5000)
        slow = np.frombuffer(ib._blend_loop(w, 5000), np.int32)
        assert np.array_equal(fast, slow), weights


def test_data_path_parsing():
    assert parse_data_path(["A"]).weights is None
    p = parse_data_path(["0.3", "A", "0.9", "B"])
    assert p.prefixes == ["A", "B"] and p.weights == pytest.approx([0.25, 0.75])
    assert parse_data_path(["A", "B", "C"]).weights is None
    with pytest.raises(ConfigError):
        parse_data_path(["0.3", "A", "B"])
    with pytest.raises(ConfigError):
        parse_data_path(["-1", "A", "2", "B"])


def test_blended_dataset_follows_index(tmp_path):
    a = write_corpus(tmp_path / "a", unique_docs([20] * 30, start=1))
    b = write_corpus(tmp_path / "b", unique_docs([15] * 40, start=100_000))
    train, valid, test = build_train_valid_test_datasets(
        ["0.25", a, "0.75", b],
        "90,10,0",
        (400, 40, 0),
        8,
        7,
        eod_token=EOD,
        cache_dir=tmp_path / "cache",
    )
    assert test is None
    for blend, n in ((train, 400), (valid, 40)):
        assert isinstance(blend, BlendedDataset) and len(blend) == n
        counts = blend.counts()
        assert [len(d) for d in blend.datasets] == counts  # components built for exactly that
        assert abs(counts[0] - n / 4) < 1
        for i in range(n):
            tokens = blend[i]["tokens"]
            origin = int(tokens[0] >= 100_000)
            assert origin == blend.dataset_index[i]
            want = blend.datasets[origin][int(blend.dataset_sample_index[i])]["tokens"]
            assert torch.equal(tokens, want)
    again = build_train_valid_test_datasets(
        ["0.25", a, "0.75", b],
        "90,10,0",
        (400, 40, 0),
        8,
        7,
        eod_token=EOD,
        cache_dir=tmp_path / "cache",
    )[0]
    back = pickle.loads(pickle.dumps(again))
    assert all(torch.equal(back[i]["tokens"], train[i]["tokens"]) for i in range(0, 400, 37))


def test_unweighted_prefixes_mix_by_tokens(tmp_path):
    a = write_corpus(tmp_path / "a", unique_docs([10] * 10))  # 100 tokens
    b = write_corpus(tmp_path / "b", unique_docs([30] * 10))  # 300 tokens
    (train, *_) = build_train_valid_test_datasets(
        [a, b], "1", (200, 0, 0), 4, 0, eod_token=EOD, cache_dir=tmp_path
    )
    assert train.weights == pytest.approx([0.25, 0.75])
    assert train.counts() == [50, 150]


# --------------------------------------------------------------------------- dataset-info


def test_dataset_info_prints_splits(tmp_path, capsys):
    from zerotron.data import info

    prefix = write_corpus(tmp_path / "c", unique_docs([100] * 9 + [57]), dtype=np.uint16)
    assert info.main(["--data-path", prefix, "--split", "8,1,1", "--seq-length", "16"]) == 0
    out = capsys.readouterr().out
    assert "10 documents, 957 tokens (uint16" in out
    assert "min 57, median 100, mean 95.7, max 100" in out
    # train: 8 docs, 800 tokens -> (800 - 1) // 16 samples; test: 1 doc of 57 tokens.
    assert re.search(r"train\s+8\s+\[0, 8\)\s+800\s+49", out)
    assert re.search(r"test\s+1\s+\[9, 10\)\s+57\s+3", out)
    capsys.readouterr()
    info.main(["--data-path", "1", prefix, "3", prefix, "--split", "8,1,1", "--seq-length", "16"])
    out = capsys.readouterr().out
    assert "blend of 2 datasets" in out and "weight 0.7500" in out


# --------------------------------------------------------------------------- per-split paths


def test_per_split_paths_take_every_document_of_their_own_data(tmp_path):
    """--train-data-path A --valid-data-path B (no test path): train serves A's documents, one
    epoch every token once, as --data-path A --split 100,0,0 would; valid serves B's; no test."""
    a_docs, b_docs = unique_docs([16] * 10, start=1), unique_docs([16] * 5, start=100_000)
    a = write_corpus(tmp_path / "a", a_docs)
    b = write_corpus(tmp_path / "b", b_docs)
    train, valid, test = build_train_valid_test_datasets(
        None, "969,30,1", (10, 5, 3), 16, 1234, per_split_paths=[[a], [b], None],
        eod_token=EOD, cache_dir=tmp_path / "cache",
    )  # fmt: skip
    assert test is None
    whole = build_train_valid_test_datasets(
        [a], "100,0,0", (10, 0, 0), 16, 1234, eod_token=EOD, cache_dir=tmp_path / "cache2"
    )[0]
    assert all(torch.equal(train[i]["tokens"], whole[i]["tokens"]) for i in range(10))
    served = np.sort(np.concatenate([train[i]["tokens"].numpy() for i in range(10)]))
    assert np.array_equal(served, np.sort(np.concatenate(a_docs)))
    served = np.sort(np.concatenate([valid[i]["tokens"].numpy() for i in range(5)]))
    assert np.array_equal(served, np.sort(np.concatenate(b_docs)))


def test_a_per_split_path_may_be_a_blend(tmp_path):
    a = write_corpus(tmp_path / "a", unique_docs([20] * 30, start=1))
    b = write_corpus(tmp_path / "b", unique_docs([15] * 40, start=100_000))
    train, valid, _ = build_train_valid_test_datasets(
        None, "969,30,1", (400, 40, 0), 8, 7, per_split_paths=[["0.25", a, "0.75", b], [a], None],
        eod_token=EOD, cache_dir=tmp_path / "cache",
    )  # fmt: skip
    assert isinstance(train, BlendedDataset) and abs(train.counts()[0] - 100) < 1
    assert all(int(valid[i]["tokens"][0]) < 100_000 for i in range(40))


def test_a_per_split_path_without_tokens_names_its_flag(tmp_path):
    a = write_corpus(tmp_path / "a", unique_docs([16] * 4))
    empty = write_corpus(tmp_path / "e", [np.array([], dtype=np.int64)] * 3)
    with pytest.raises(DataError, match="the valid data has no tokens") as e:
        build_train_valid_test_datasets(
            None, "1", (4, 2, 0), 8, 1, per_split_paths=[[a], [empty], None], eod_token=EOD,
            cache_dir=tmp_path / "cache",
        )  # fmt: skip
    assert e.value.fix == "check --valid-data-path"
