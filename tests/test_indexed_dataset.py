"""Megatron's MMapIndexedDataset format: exact bytes against the spec, round trips, bad files.

The spec is assembled here with ``struct`` from Megatron-LM's description (not from our
encoder): 9-byte magic, <Q version 1, <B dtype code, <Q sequence count, <Q document-index
count, int32 lengths, int64 byte pointers, int64 document index.
"""

import os
import struct

import numpy as np
import pytest

from zerotron.data.indexed_dataset import (
    MMapIndexedDataset,
    MMapIndexedDatasetBuilder,
    best_dtype,
    encode_index,
)
from zerotron.errors import DataError


def spec_idx(code: int, itemsize: int, docs: list[list[list[int]]]) -> bytes:
    """The .idx of ``docs`` (each a list of sequences), byte by byte from the format spec."""
    lengths = [len(seq) for doc in docs for seq in doc]
    pointers, at = [], 0
    for n in lengths:
        pointers.append(at)
        at += n * itemsize
    doc_idx = [0]
    for doc in docs:
        doc_idx.append(doc_idx[-1] + len(doc))
    out = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code)
    out += struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(doc_idx))
    out += b"".join(struct.pack("<i", n) for n in lengths)
    out += b"".join(struct.pack("<q", p) for p in pointers)
    out += b"".join(struct.pack("<q", d) for d in doc_idx)
    return out


def spec_bin(fmt: str, docs) -> bytes:
    return b"".join(struct.pack(fmt, t) for doc in docs for seq in doc for t in seq)


DOCS = [[[5, 6, 7]], [[65535, 0], [1]], [[42]], [[]], [[9, 8, 7, 6, 5, 4]]]


@pytest.mark.parametrize("dtype,code,fmt", [(np.uint16, 8, "<H"), (np.int32, 4, "<i")])
def test_bytes_match_spec(tmp_path, dtype, code, fmt):
    docs = DOCS if dtype == np.uint16 else [[[t * 1000 for t in s] for s in d] for d in DOCS]
    prefix = tmp_path / "small"
    with MMapIndexedDatasetBuilder(prefix, dtype) as b:
        for doc in docs:
            if len(doc) == 1:
                b.add_item(doc[0])
                b.end_document()
            else:
                b.add_document(sum(doc, []), lengths=[len(s) for s in doc])
    assert (tmp_path / "small.idx").read_bytes() == spec_idx(code, np.dtype(dtype).itemsize, docs)
    assert (tmp_path / "small.bin").read_bytes() == spec_bin(fmt, docs)
    assert sorted(os.listdir(tmp_path)) == ["small.bin", "small.idx"]  # no temporary left


def test_reads_files_written_from_the_spec(tmp_path):
    # The other direction: files another tool (Megatron-LM) wrote, here assembled by hand.
    (tmp_path / "m.idx").write_bytes(spec_idx(8, 2, DOCS))
    (tmp_path / "m.bin").write_bytes(spec_bin("<H", DOCS))
    ds = MMapIndexedDataset(tmp_path / "m")
    assert ds.dtype == np.uint16 and len(ds) == 6 and ds.num_documents == 5
    assert ds.sizes.tolist() == [3, 2, 1, 1, 0, 6]
    assert ds.doc_idx.tolist() == [0, 1, 3, 4, 5, 6]
    assert ds.num_tokens == 13
    assert ds[1].tolist() == [65535, 0]
    assert ds.get(5, offset=2, length=3).tolist() == [7, 6, 5]
    assert ds.document(1).tolist() == [65535, 0, 1]
    assert ds.document(3).tolist() == []


def test_encode_index_matches_spec():
    sizes = [3, 0, 1]
    docs = [[[1, 2, 3], []], [[4]]]
    assert encode_index(np.int32, sizes, [0, 2, 3]) == spec_idx(4, 4, docs)


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_round_trip_10000_random_documents(tmp_path, dtype):
    rng = np.random.default_rng(0 if dtype == np.uint16 else 1)
    n = 10_000
    # Lengths: many empty and single-token documents, the rest up to 300 tokens.
    lengths = rng.choice([0, 1, 2, 17, 300], size=n) * (rng.random(n) < 0.9)
    lengths = np.where(rng.random(n) < 0.5, rng.integers(0, 301, size=n), lengths)
    high = 50257 if dtype == np.uint16 else 2**31 - 1
    tokens = [rng.integers(0, high, size=k).astype(dtype) for k in lengths]
    prefix = tmp_path / "rt"
    with MMapIndexedDatasetBuilder(prefix, dtype) as b:
        half = n // 2
        for t in tokens[:half]:  # one at a time
            b.add_item(t)
            b.end_document()
        b.add_documents(np.concatenate(tokens[half:]), lengths[half:])  # the batched path
    ds = MMapIndexedDataset(prefix)
    assert ds.dtype == np.dtype(dtype)
    assert ds.num_documents == len(ds) == n
    assert ds.sizes.tolist() == lengths.tolist()
    assert ds.doc_idx.tolist() == list(range(n + 1))
    assert ds.num_tokens == int(lengths.sum())
    assert {0, 1} <= set(lengths.tolist())
    for i in range(n):
        assert np.array_equal(ds[i], tokens[i])
        assert np.array_equal(ds.document(i), tokens[i])
    k = int(np.argmax(lengths))
    assert np.array_equal(ds.get(k, 5, 10), tokens[k][5:15])


def test_best_dtype():
    assert best_dtype(50257) == np.uint16 and best_dtype(65499) == np.uint16
    assert best_dtype(65500) == np.int32 and best_dtype(256_000) == np.int32


def test_builder_abort_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError), MMapIndexedDatasetBuilder(tmp_path / "x") as b:
        b.add_item([1, 2, 3])
        raise RuntimeError("interrupted")
    assert os.listdir(tmp_path) == []


def test_builder_replaces_an_old_pair(tmp_path):
    for tokens in ([1, 2, 3], [7]):
        with MMapIndexedDatasetBuilder(tmp_path / "x") as b:
            b.add_document(tokens)
    ds = MMapIndexedDataset(tmp_path / "x")
    assert ds.document(0).tolist() == [7]
    assert sorted(os.listdir(tmp_path)) == ["x.bin", "x.idx"]


@pytest.fixture
def good(tmp_path):
    (tmp_path / "g.idx").write_bytes(spec_idx(8, 2, DOCS))
    (tmp_path / "g.bin").write_bytes(spec_bin("<H", DOCS))
    return tmp_path / "g"


def _corrupt(path, data):
    path.write_bytes(data)


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda idx, b: _corrupt(idx, b""), "truncated"),
        (lambda idx, b: _corrupt(idx, idx.read_bytes()[:20]), "truncated"),
        (lambda idx, b: _corrupt(idx, idx.read_bytes()[:-9]), r"truncated \(\d+ of \d+ bytes\)"),
        (lambda idx, b: _corrupt(b, b.read_bytes()[:-1]), r"data file is truncated"),
        (lambda idx, b: _corrupt(idx, b"MMIDIDY" + idx.read_bytes()[7:]), "not a Megatron"),
        (lambda idx, b: _corrupt(idx, idx.read_bytes()[:9] + b"\x02" + idx.read_bytes()[10:]),
         "unsupported index version 2"),
        (lambda idx, b: _corrupt(idx, idx.read_bytes()[:17] + b"\x63" + idx.read_bytes()[18:]),
         "unknown dtype code 99"),
        (lambda idx, b: _corrupt(idx, idx.read_bytes()[:-8] + struct.pack("<q", 5)),
         "corrupt document index"),
        (lambda idx, b: idx.unlink(), "file not found"),
        (lambda idx, b: b.unlink(), "file not found"),
    ],
)  # fmt: skip
def test_damaged_files_are_clear_errors(good, damage, message):
    idx, bin_ = good.with_suffix(".idx"), good.with_suffix(".bin")
    damage(idx, bin_)
    with pytest.raises(DataError, match=message) as e:
        MMapIndexedDataset(good)
    assert "g.idx" in str(e.value) or "g.bin" in str(e.value)
