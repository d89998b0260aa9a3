"""Bad data gets a clean zerotron error, never a traceback or a partial file (issue 19: F5, F7).

Each corruption is made by hand in a small file and run through the CLI entry point in
process (``zerotron.cli.main``): exit code 2, ``zerotron <command>: error: <where>: <what>``
and a ``->`` line saying what to do. A seeded fuzz over ``.idx`` bytes and preprocess inputs
checks the same contract on random damage.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from zerotron.cli import main as cli
from zerotron.data import index_builder as ib
from zerotron.data.indexed_dataset import HEADER, MMapIndexedDataset, MMapIndexedDatasetBuilder
from zerotron.data.preprocess import preprocess
from zerotron.data.tokenizer import GPT2BPETokenizer
from zerotron.errors import DataError

REPO = Path(__file__).resolve().parents[2]
DOCS = [[5, 6, 7], [1, 2], [42], [9, 8, 7, 6], [3, 3, 3], [11]]  # 6 documents, 14 tokens


def write_pair(prefix: Path, docs=DOCS, dtype=np.uint16) -> Path:
    with MMapIndexedDatasetBuilder(prefix, dtype) as b:
        for doc in docs:
            b.add_document(doc)
    return prefix


def patch(path: Path, offset: int, fmt: str, value: int) -> None:
    """Overwrite one little-endian field of ``path`` in place."""
    data = bytearray(path.read_bytes())
    struct.pack_into(fmt, data, offset, value)
    path.write_bytes(bytes(data))


def sizes_at(i: int) -> int:
    return HEADER.size + 4 * i


def pointers_at(i: int, n: int = len(DOCS)) -> int:
    return HEADER.size + 4 * n + 8 * i


def doc_idx_at(i: int, n: int = len(DOCS)) -> int:
    return HEADER.size + 12 * n + 8 * i


def clean_error(argv: list[str], capsys) -> str:
    """Run the CLI; assert exit 2 with a clean message and a fix. Returns stderr, unwrapped."""
    capsys.readouterr()
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"zerotron {argv[0]}: error: "), err
    assert "Traceback" not in err and "\n  -> " in err, err
    return err


def info_error(prefix: Path, capsys, *extra: str) -> str:
    return clean_error(["dataset-info", "--data-path", str(prefix), *extra], capsys)


# --------------------------------------------------------------------------- F7: corrupt .idx


@pytest.fixture
def pair(tmp_path) -> Path:
    return write_pair(tmp_path / "d")


def test_negative_size_in_the_middle_is_refused(pair, capsys):
    patch(pair.with_suffix(".idx"), sizes_at(2), "<i", -7)
    err = info_error(pair, capsys)
    assert "d.idx: sequence 2 of 6: negative size -7 tokens" in err


def test_huge_size_in_the_middle_is_refused(pair, capsys):
    patch(pair.with_suffix(".idx"), sizes_at(3), "<i", 1 << 30)
    err = info_error(pair, capsys)
    assert "d.idx: sequence 3 of 6: size 1,073,741,824 tokens, but the next sequence starts " in err
    assert "8 bytes after it (4 tokens)" in err


def test_huge_last_size_is_refused(pair, capsys):
    patch(pair.with_suffix(".idx"), sizes_at(5), "<i", 1 << 30)
    err = info_error(pair, capsys)
    assert "d.idx: sequence 5 of 6: size 1,073,741,824 tokens (2,147,483,648 bytes)" in err
    assert "is more than the .bin holds (28 bytes)" in err


def test_truncated_bin_blames_the_bin(pair, capsys):
    pair.with_suffix(".bin").write_bytes(pair.with_suffix(".bin").read_bytes()[:4])
    err = info_error(pair, capsys)
    assert "d.bin: data file is truncated (4 of 28 bytes)" in err


def test_bad_pointer_in_the_middle_is_refused(pair, capsys):
    patch(pair.with_suffix(".idx"), pointers_at(4), "<q", 2)
    err = info_error(pair, capsys)
    assert "d.idx: sequence 4 of 6: pointer 2 should be 20" in err


def test_size_that_disagrees_with_the_next_pointer_is_refused(pair, capsys):
    # Size 1 -> 2 stays inside the .bin, but the next sequence no longer starts where it ends.
    patch(pair.with_suffix(".idx"), sizes_at(2), "<i", 2)
    err = info_error(pair, capsys)
    assert (
        "sequence 2 of 6: size 2 tokens, but the next sequence starts 2 bytes after it (1 " in err
    )


def test_doc_idx_out_of_range_is_refused(pair, capsys):
    patch(pair.with_suffix(".idx"), doc_idx_at(3), "<q", 99)
    err = info_error(pair, capsys)
    assert "d.idx: corrupt document index: entry 3 of 7 is 99, outside [0, 6]" in err


def test_doc_idx_going_backwards_is_refused(pair, capsys):
    patch(pair.with_suffix(".idx"), doc_idx_at(4), "<q", 1)
    err = info_error(pair, capsys)
    assert "entry 4 of 7 is 1, less than the entry before it (3)" in err


def test_doc_idx_negative_is_refused(pair, capsys):
    patch(pair.with_suffix(".idx"), doc_idx_at(1), "<q", -5)
    err = info_error(pair, capsys)
    assert "entry 1 of 7 is -5, outside [0, 6]" in err


def test_bin_longer_than_its_index_is_refused(pair, capsys):
    with open(pair.with_suffix(".bin"), "ab") as f:
        f.write(b"\0\0")
    err = info_error(pair, capsys)
    assert "d.bin: data file has 30 bytes but its index describes only 28" in err


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda b: b[:20], r"index file is truncated \(20 bytes, header alone is 34\)"),
        (lambda b: b[:-9], r"index file is truncated \(\d+ of \d+ bytes\): its header announces"),
        (lambda b: b"MMIDIDY" + b[7:], r"not a Megatron MMIDIDX index"),
        (lambda b: b[:9] + b"\x02" + b[10:], r"unsupported index version 2 \(only version 1"),
        (lambda b: b[:17] + b"\x63" + b[18:], r"unknown dtype code 99 \(known: "),
    ],
    ids=["short-header", "short-arrays", "magic", "version", "dtype"],
)
def test_damaged_header_is_a_clean_error_with_a_fix(pair, capsys, damage, message):
    idx = pair.with_suffix(".idx")
    idx.write_bytes(damage(idx.read_bytes()))
    assert re.search(message, info_error(pair, capsys))


def test_merge_refuses_a_corrupt_input_and_writes_nothing(pair, tmp_path, capsys):
    patch(pair.with_suffix(".idx"), sizes_at(1), "<i", -1)
    out = tmp_path / "out"
    out.mkdir()
    args = ["merge-datasets", "--input", str(pair), "--output-prefix", str(out / "m")]
    assert "negative size -1" in clean_error(args, capsys)
    assert os.listdir(out) == []


def test_fuzzed_idx_is_refused_or_consistent(tmp_path):
    """Random byte damage in an .idx: a DataError, or a dataset whose every read is in range."""
    rng = np.random.default_rng(19)
    good = write_pair(tmp_path / "g")
    body = good.with_suffix(".idx").read_bytes()
    prefix = tmp_path / "f"
    shutil.copy(good.with_suffix(".bin"), prefix.with_suffix(".bin"))
    for _ in range(300):
        data = bytearray(body)
        for at in rng.integers(0, len(data), size=int(rng.integers(1, 4))):
            data[at] = int(rng.integers(0, 256))
        prefix.with_suffix(".idx").write_bytes(bytes(data))
        try:
            ds = MMapIndexedDataset(prefix)
        except DataError:
            continue
        assert (ds.sizes >= 0).all() and ds.num_tokens * ds.dtype.itemsize == 28
        assert sum(len(ds.document(d)) for d in range(ds.num_documents)) == ds.num_tokens


# --------------------------------------------------------------------------- F5: token ids


def test_token_id_beyond_the_vocabulary_is_refused_at_load(tmp_path, data_prefix, capsys):
    prefix = tmp_path / "rand"
    for ext in (".bin", ".idx"):
        shutil.copy(data_prefix + ext, prefix.with_suffix(ext))
    patch(prefix.with_suffix(".bin"), 2000, "<H", 65535)  # GPT-2 has 50,257 ids
    tiny = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2"]
    tiny += ["--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "1"]
    tiny += ["--lr", "1e-3", "--train-iters", "2", "--eval-iters", "0", "--split", "100,0,0"]
    err = clean_error(["pretrain", *tiny, "--data-path", str(prefix)], capsys)
    assert "rand.bin: token id 65535 at byte offset 2,000 (token 1,000, sequence " in err
    assert "outside the vocabulary of 50,257 ids" in err


def test_negative_token_id_is_refused(tmp_path):
    ds = MMapIndexedDataset(write_pair(tmp_path / "neg", [[1, 2], [3, -4, 5]], np.int32))
    with pytest.raises(DataError, match=r"token id -4 at byte offset 12 \(token 3, sequence 1, "):
        ds.check_token_ids(10)


def test_token_ids_below_the_vocabulary_pass(tmp_path):
    MMapIndexedDataset(write_pair(tmp_path / "ok", [[0, 2], [3, 5]], np.int32)).check_token_ids(6)


# --------------------------------------------------------------------------- F5: preprocess


LINES = [json.dumps({"text": f"line {i}: " + "word " * (i % 17)}) + "\n" for i in range(3000)]


@pytest.fixture
def jsonl_gz(tmp_path) -> Path:
    path = tmp_path / "in.jsonl.gz"
    # Level 0 stores the text: damage at a byte offset lands at a predictable line.
    with gzip.open(path, "wb", compresslevel=0) as f:
        f.write("".join(LINES).encode())
    return path


def preprocess_error(src: Path, tmp_path: Path, capsys, *extra: str) -> str:
    """A failing `zerotron preprocess` run; no file may be left in its output directory."""
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    args = ["preprocess", "--input", str(src), "--output-prefix", str(out / "p"), *extra]
    err = clean_error([*args, "--workers", "1"], capsys)
    assert os.listdir(out) == []
    return err


def test_truncated_gzip_names_file_and_line(jsonl_gz, tmp_path, capsys):
    data = jsonl_gz.read_bytes()
    jsonl_gz.write_bytes(data[: len(data) // 2])
    err = preprocess_error(jsonl_gz, tmp_path, capsys)
    line = int(re.search(r"in\.jsonl\.gz:(\d+): the gzip file is truncated", err).group(1))
    assert 1000 < line < 2000  # about half way through 3000 lines
    assert "gzip -t" in err


def test_not_a_gzip_file_is_refused(tmp_path, capsys):
    src = tmp_path / "plain.jsonl.gz"
    src.write_text("".join(LINES[:5]))
    err = preprocess_error(src, tmp_path, capsys)
    assert "plain.jsonl.gz:1: not a gzip file, though its name ends in .gz" in err


def test_corrupt_gzip_is_refused(tmp_path, capsys):
    src = tmp_path / "bad.jsonl.gz"
    src.write_bytes(gzip.compress("".join(LINES).encode()))
    data = bytearray(src.read_bytes())
    data[len(data) // 3] ^= 0xFF
    src.write_bytes(bytes(data))
    err = preprocess_error(src, tmp_path, capsys)
    assert re.search(r"bad\.jsonl\.gz:\d+: (corrupt gzip data|malformed JSON|invalid UTF-8)", err)


def test_deeply_nested_json_names_the_line(tmp_path, capsys):
    src = tmp_path / "deep.jsonl"
    src.write_text(LINES[0] + "[" * 100_000 + "]" * 100_000 + "\n")
    err = preprocess_error(src, tmp_path, capsys)
    assert "deep.jsonl:2: JSON nested too deeply to decode" in err


def test_huge_json_integer_names_the_line(tmp_path, capsys):
    src = tmp_path / "int.jsonl"
    src.write_text(LINES[0] + '{"text": "a", "n": ' + "9" * 5000 + "}\n")
    err = preprocess_error(src, tmp_path, capsys)
    assert "int.jsonl:2: malformed JSON: " in err


def test_fuzzed_preprocess_inputs_fail_cleanly(tmp_path):
    """Random damage to a .jsonl and a .jsonl.gz: success or a DataError, never a stray file."""
    rng = np.random.default_rng(5)
    plain = "".join(LINES[:40]).encode()
    packed = gzip.compress(plain)
    out = tmp_path / "out"
    out.mkdir()
    tokenizer = GPT2BPETokenizer()
    for case in range(200):
        src = tmp_path / ("in.jsonl.gz" if case % 2 else "in.jsonl")
        data = bytearray(packed if case % 2 else plain)
        for at in rng.integers(0, len(data), size=int(rng.integers(1, 6))):
            data[at] = int(rng.integers(0, 256))
        if rng.random() < 0.3:
            data = data[: int(rng.integers(0, len(data)))]
        src.write_bytes(bytes(data))
        try:
            preprocess([src], out / "p", tokenizer, workers=1, progress=False)
        except DataError:
            assert os.listdir(out) == [], case
            continue
        assert sorted(os.listdir(out)) == ["p_text_document.bin", "p_text_document.idx"], case
        for name in os.listdir(out):
            os.unlink(out / name)


# --------------------------------------------------------------------------- --split examples


def test_readme_split_examples_fit_the_bundled_corpus():
    """Every ``--split`` in the README gives each of the 270 Austen documents' splits one."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    splits = re.findall(r"--split (\S+)", readme)
    assert splits
    for split in splits:
        ranges = ib.split_ranges(split, 270)
        assert all(hi > lo for lo, hi in ranges), (split, ranges)


def test_dataset_info_proposes_a_split_where_one_is_empty(tmp_path, capsys):
    prefix = write_pair(tmp_path / "c270", [[i + 1] for i in range(270)])
    capsys.readouterr()
    assert cli(["dataset-info", "--data-path", str(prefix), "--split", "949,50,1"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "test split is empty (asking for test samples is an error); --split 98,1,1" in out
    assert ib.split_ranges("98,1,1", 270)[2] == (267, 270)
