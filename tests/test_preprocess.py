"""``zerotron preprocess`` and ``zerotron merge-datasets``: exact output bytes, bad input, kills.

Expected files are assembled here from the format spec with ``struct``, and expected ids come
from HuggingFace ``tokenizers`` built from the same local GPT-2 files (an independent BPE).
"""

import gzip
import json
import os
import selectors
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

import zerotron.data.preprocess as pp
from zerotron.cli import main as cli
from zerotron.data import merge
from zerotron.data.indexed_dataset import MMapIndexedDataset
from zerotron.errors import ConfigError, DataError, UnsupportedError

REPO = Path(__file__).resolve().parents[1]
GPT2 = REPO / "zerotron" / "data" / "gpt2"
EOD = 50256


@pytest.fixture(scope="module")
def hf():
    tok = Tokenizer(models.BPE.from_file(str(GPT2 / "encoder.json"), str(GPT2 / "vocab.bpe")))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    return tok


def spec_files(docs: list[list[int]], fmt: str = "<H", code: int = 8) -> tuple[bytes, bytes]:
    """(.idx, .bin) of one-sequence documents, from Megatron's format description."""
    size = struct.calcsize(fmt)
    idx = b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, code, len(docs), len(docs) + 1)
    idx += b"".join(struct.pack("<i", len(d)) for d in docs)
    at = 0
    for d in docs:
        idx += struct.pack("<q", at)
        at += len(d) * size
    idx += b"".join(struct.pack("<q", i) for i in range(len(docs) + 1))
    return idx, b"".join(struct.pack(fmt, t) for d in docs for t in d)


def read_pair(prefix) -> tuple[bytes, bytes]:
    return Path(f"{prefix}.idx").read_bytes(), Path(f"{prefix}.bin").read_bytes()


def write_lines(path: Path, objs) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for o in objs:
            f.write((o if isinstance(o, str) else json.dumps(o, ensure_ascii=False)) + "\n")
    return path


def run(*args) -> int:
    return pp.main([str(a) for a in args])


SMALL = [
    {"text": "Hello world", "title": "A"},
    {"text": "", "title": "B"},
    "   ",
    {"text": "日本語 🤖\r\n x\x00y  ", "title": ""},
    {"text": "<|endoftext|> 12345678901234", "title": "C  D", "extra": 1},
    {"title": "E", "text": "they're 'll"},
]


def test_output_bytes_match_spec_for_two_keys(tmp_path, hf, capsys):
    src = write_lines(tmp_path / "in.jsonl", SMALL)
    out = tmp_path / "out" / "c"
    args = ["--input", src, "--output-prefix", out, "--json-keys", "text", "title"]
    assert run(*args, "--append-eod", "--workers", "1") == 0
    for key in ("text", "title"):
        texts = [o[key] for o in SMALL if isinstance(o, dict) and o[key]]
        expect = spec_files([hf.encode(t).ids + [EOD] for t in texts])
        assert read_pair(f"{out}_{key}_document") == expect
    summary = capsys.readouterr().out
    assert "preprocessed 5 documents" in summary
    assert "2 empty documents, 0 invalid lines, 1 blank lines" in summary
    assert f"{out}_title_document.bin" in summary
    assert sorted(os.listdir(out.parent)) == sorted(
        f"c_{k}_document.{e}" for k in ("text", "title") for e in ("bin", "idx")
    )


def test_without_append_eod(tmp_path, hf):
    src = write_lines(tmp_path / "in.jsonl", SMALL)
    run("--input", src, "--output-prefix", tmp_path / "o")
    texts = [o["text"] for o in SMALL if isinstance(o, dict) and o["text"]]
    assert read_pair(tmp_path / "o_text_document") == spec_files([hf.encode(t).ids for t in texts])


def test_worker_pool_keeps_input_order(tmp_path, hf, austen_path, monkeypatch):
    with open(austen_path, encoding="utf-8") as f:
        texts = [json.loads(next(f))["text"][:3000] for _ in range(60)]
    src = write_lines(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    monkeypatch.setattr(pp, "CHUNK_BYTES", 4000)  # ~45 chunks over 2 workers
    run("--input", src, "--output-prefix", tmp_path / "w2", "--workers", "2", "--append-eod")
    expect = spec_files([e.ids + [EOD] for e in hf.encode_batch(texts)])
    assert read_pair(tmp_path / "w2_text_document") == expect


def test_gz_json_and_glob_inputs_equal_one_file(tmp_path):
    objs = [{"text": f"document {i} " * (i % 7)} for i in range(30)]
    d = tmp_path / "parts"
    d.mkdir()
    write_lines(d / "a.jsonl", objs[:10])
    write_lines(d / "b.json", objs[10:20])
    with gzip.open(d / "c.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(o) + "\n" for o in objs[20:])
    write_lines(tmp_path / "all.jsonl", objs)
    run("--input", d / "*", "--output-prefix", tmp_path / "g", "--append-eod")
    run("--input", tmp_path / "all.jsonl", "--output-prefix", tmp_path / "one", "--append-eod")
    assert read_pair(tmp_path / "g_text_document") == read_pair(tmp_path / "one_text_document")


def test_byte_order_mark_and_missing_final_newline(tmp_path, hf):
    src = tmp_path / "bom.jsonl"
    src.write_bytes(b"\xef\xbb\xbf" + b'{"text": "a"}\n{"text": "b c"}')
    run("--input", src, "--output-prefix", tmp_path / "o")
    expect = spec_files([hf.encode("a").ids, hf.encode("b c").ids])
    assert read_pair(tmp_path / "o_text_document") == expect


def test_vocab_at_least_65500_writes_int32(tmp_path):
    class WideTokenizer:  # a stand-in with a big vocabulary: one id per character
        vocab_size, eod = 70_000, 69_999

        def tokenize(self, text):
            return [60_000 + ord(c) for c in text]

    src = write_lines(tmp_path / "in.jsonl", [{"text": "ab"}, {"text": "xyz"}])
    pp.preprocess([src], tmp_path / "w", WideTokenizer(), append_eod=True)
    docs = [[60_097, 60_098, 69_999], [60_120, 60_121, 60_122, 69_999]]
    assert read_pair(tmp_path / "w_text_document") == spec_files(docs, "<i", 4)


# --------------------------------------------------------------------------- bad input

GOOD = '{"text": "fine"}'
BAD_LINES = [
    ('{"text": "unterminated}', "malformed JSON"),
    ('{"title": "no text key"}', "missing key 'text'"),
    ('{"text": 17}', "value of 'text' is a int, expected a string"),
    ('["a", "list"]', "expected a JSON object, got list"),
]


@pytest.mark.parametrize("line,message", BAD_LINES)
def test_bad_line_names_file_and_line_and_writes_nothing(tmp_path, line, message, capsys):
    src = write_lines(tmp_path / "in.jsonl", [GOOD, GOOD, line, GOOD])
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(DataError, match=message) as e:
        run("--input", src, "--output-prefix", out / "p")
    assert f"{src}:3" in str(e.value) and "--skip-invalid" in str(e.value)
    assert os.listdir(out) == []
    # Through the CLI: a one-line message, exit status 2.
    assert cli(["preprocess", "--input", str(src), "--output-prefix", str(out / "p")]) == 2
    err = capsys.readouterr().err
    assert f"zerotron preprocess: error: {src}:3: " in err and "Traceback" not in err


def test_invalid_utf8_names_file_and_byte_offset(tmp_path):
    src = tmp_path / "in.jsonl"
    first, second = b'{"text": "ok"}\n', b'{"text": "caf\xe9 au lait"}\n'
    src.write_bytes(first + second)
    with pytest.raises(DataError, match="invalid UTF-8") as e:
        run("--input", src, "--output-prefix", tmp_path / "out" / "p")
    offset = len(first) + second.index(b"\xe9")
    assert f"byte offset {offset} " in str(e.value) and str(src) in str(e.value)
    assert not (tmp_path / "out").exists() or os.listdir(tmp_path / "out") == []


def test_skip_invalid_skips_and_counts(tmp_path, capsys):
    lines = [GOOD] + [line for line, _ in BAD_LINES] + ['{"text": "also fine"}']
    src = write_lines(tmp_path / "in.jsonl", lines)
    with open(src, "ab") as f:
        f.write(b'{"text": "\xff"}\n')
    run("--input", src, "--output-prefix", tmp_path / "s", "--skip-invalid")
    assert "5 invalid lines" in capsys.readouterr().out
    clean = write_lines(tmp_path / "clean.jsonl", [GOOD, '{"text": "also fine"}'])
    run("--input", clean, "--output-prefix", tmp_path / "c")
    assert read_pair(tmp_path / "s_text_document") == read_pair(tmp_path / "c_text_document")


def test_no_documents_is_an_error(tmp_path):
    src = write_lines(tmp_path / "in.jsonl", [{"text": ""}, {"text": ""}])
    with pytest.raises(DataError, match="no documents with text under key 'text'"):
        run("--input", src, "--output-prefix", tmp_path / "out" / "p")
    assert os.listdir(tmp_path / "out") == []


def test_missing_input_and_bad_suffix(tmp_path):
    with pytest.raises(DataError, match="no such input file"):
        run("--input", tmp_path / "nope.jsonl", "--output-prefix", tmp_path / "p")
    with pytest.raises(DataError, match="matches no file"):
        run("--input", tmp_path / "*.jsonl", "--output-prefix", tmp_path / "p")
    (tmp_path / "x.txt").write_text("hello")
    with pytest.raises(DataError, match="unsupported input type"):
        run("--input", tmp_path / "x.txt", "--output-prefix", tmp_path / "p")


def test_flags(tmp_path):
    src = write_lines(tmp_path / "in.jsonl", [GOOD])
    base = ["--input", src, "--output-prefix", tmp_path / "p"]
    with pytest.raises(UnsupportedError, match="--split-sentences"):
        run(*base, "--split-sentences")
    with pytest.raises(UnsupportedError, match="mmap"):
        run(*base, "--dataset-impl", "lazy")
    with pytest.raises(ConfigError, match="did you mean --json-keys"):
        run(*base, "--json-key", "text")
    with pytest.raises(ConfigError, match="--workers must be at least 1"):
        run(*base, "--workers", "0")
    with pytest.raises(ConfigError, match="supported: GPT2BPETokenizer"):
        run(*base, "--tokenizer-type", "GPT3BPETokenizer")
    with pytest.raises(ConfigError, match="required"):
        run("--input", src)


def test_log_lines_and_progress_bar(tmp_path, capsys):
    src = write_lines(tmp_path / "in.jsonl", [{"text": f"doc {i}"} for i in range(10)])
    run("--input", src, "--output-prefix", tmp_path / "a", "--log-interval", "4")
    err = capsys.readouterr().err
    assert "Processed 10 documents (" in err
    assert "docs/s" in err and "MB/s" in err and "tokens/s" in err
    pp.preprocess([src], tmp_path / "b", progress=True)  # the rich bar (as on a terminal)
    assert read_pair(tmp_path / "a_text_document") == read_pair(tmp_path / "b_text_document")


# --------------------------------------------------------------------------- interruption

# A shell's Ctrl-C reaches a command whose SIGINT is at Python's default. A child inherits an
# ignored SIGINT (and Python then keeps ignoring it, as it should for `cmd &`), so the run
# restores the default rather than depend on what the test worker's earlier tests left.
SLOW_RUN = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
import zerotron.data.preprocess as pp
from zerotron.cli import main
pp.CHUNK_BYTES = 1  # one line per chunk
encode = pp.Encoder.encode_chunk
pp.Encoder.encode_chunk = lambda self, chunk: (time.sleep(0.05), encode(self, chunk))[1]
sys.exit(main(["preprocess", "--input", sys.argv[1], "--output-prefix", sys.argv[2],
               "--workers", sys.argv[3], "--log-interval", "1"]))
"""


def _start_and_wait_for_progress(tmp_path, workers):
    src = write_lines(tmp_path / "in.jsonl", [{"text": f"document {i}"} for i in range(400)])
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_RUN, str(src), str(out / "p"), str(workers)],
        cwd=REPO,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    sel = selectors.DefaultSelector()
    sel.register(proc.stderr, selectors.EVENT_READ)
    deadline = time.monotonic() + 30
    seen = b""
    while b"Processed" not in seen:
        assert time.monotonic() < deadline and proc.poll() is None, seen.decode()
        if sel.select(timeout=1):
            seen += os.read(proc.stderr.fileno(), 4096)
    return proc, out


@pytest.mark.parametrize(
    "sig,workers,status",
    [(signal.SIGKILL, 1, -9), (signal.SIGINT, 1, 130), (signal.SIGTERM, 2, 143)],
)
def test_interrupted_run_leaves_no_complete_pair(tmp_path, sig, workers, status):
    proc, out = _start_and_wait_for_progress(tmp_path, workers)
    proc.send_signal(sig)
    assert proc.wait(timeout=30) == status
    proc.stderr.close()
    left = os.listdir(out)
    assert "p_text_document.idx" not in left and "p_text_document.bin" not in left
    if sig != signal.SIGKILL:  # a signal Python can see also removes the temporary files
        assert left == []


# --------------------------------------------------------------------------- merge-datasets


def test_merge_equals_preprocessing_the_concatenation(tmp_path, capsys):
    a = [{"text": f"first file {i} " * i} for i in range(1, 12)]
    b = [{"text": f"второй файл {i}"} for i in range(7)]
    parts = tmp_path / "parts"
    parts.mkdir()
    run("--input", write_lines(tmp_path / "a.jsonl", a), "--output-prefix", parts / "a",
        "--append-eod")  # fmt: skip
    run("--input", write_lines(tmp_path / "b.jsonl", b), "--output-prefix", parts / "b",
        "--append-eod")  # fmt: skip
    run("--input", write_lines(tmp_path / "ab.jsonl", a + b), "--output-prefix",
        tmp_path / "ab", "--append-eod")  # fmt: skip
    expect = read_pair(tmp_path / "ab_text_document")
    pa, pb = parts / "a_text_document", parts / "b_text_document"
    assert merge.main(["--input", str(pa), str(pb), "--output-prefix", str(tmp_path / "m1")]) == 0
    assert read_pair(tmp_path / "m1") == expect
    assert "merged 2 datasets: 18 documents" in capsys.readouterr().out
    # Megatron's form: a directory, pairs merged in name order; the output there is skipped.
    assert merge.main(["--input", str(parts), "--output-prefix", str(parts / "zz")]) == 0
    assert read_pair(parts / "zz") == expect
    assert merge.main(["--input", str(parts), "--output-prefix", str(parts / "zz")]) == 0
    assert read_pair(parts / "zz") == expect
    # A path with .bin/.idx is taken as its prefix; the order given is kept.
    merge.main(["--input", f"{pb}.idx", f"{pa}.bin", "--output-prefix", str(tmp_path / "ba")])
    ba = MMapIndexedDataset(tmp_path / "ba")
    da, db = MMapIndexedDataset(pa), MMapIndexedDataset(pb)
    assert ba.num_documents == da.num_documents + db.num_documents
    assert np.array_equal(ba.document(0), db.document(0))
    assert np.array_equal(ba.document(db.num_documents), da.document(0))


def test_merge_errors(tmp_path):
    src = write_lines(tmp_path / "in.jsonl", [GOOD])
    run("--input", src, "--output-prefix", tmp_path / "a")
    with pytest.raises(DataError, match="file not found"):
        merge.main(["--input", str(tmp_path / "nope"), "--output-prefix", str(tmp_path / "m")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no .bin/.idx pairs"):
        merge.main(["--input", str(tmp_path / "empty"), "--output-prefix", str(tmp_path / "m")])
    wide = tmp_path / "wide_text_document"
    Path(f"{wide}.idx").write_bytes(spec_files([[1]], "<i", 4)[0])
    Path(f"{wide}.bin").write_bytes(spec_files([[1]], "<i", 4)[1])
    a = str(tmp_path / "a_text_document")
    with pytest.raises(DataError, match="dtype int32 differs"):
        merge.main(["--input", a, str(wide), "--output-prefix", str(tmp_path / "out" / "m")])
    assert os.listdir(tmp_path / "out") == []
    with pytest.raises(DataError, match="output prefix is also an input"):
        merge.main(["--input", a, "--output-prefix", a])
