"""``zerotron preprocess``: loose JSON lines -> Megatron ``.bin/.idx`` token files.

Same flags and output as Megatron-LM's ``tools/preprocess_data.py``: each line of the input is a
JSON object; the text under each ``--json-keys`` key is tokenized and written as one document to
``{output_prefix}_{key}_document.bin/.idx``.

How it stays fast with flat memory: the parent reads raw lines in chunks of ~256 KB and hands
them to a pool of workers, at most a few chunks per worker in flight; a worker decodes the JSON,
tokenizes with tiktoken and sends back one numpy array of tokens and one of lengths per chunk;
the parent appends those to the output in input order. Nothing grows with the corpus except the
index (12 bytes per document).

Bad input stops the run naming ``file:line`` (``--skip-invalid`` skips and counts such lines);
output files appear only when complete (see :class:`MMapIndexedDatasetBuilder`).
"""

from __future__ import annotations

import contextlib
import glob
import gzip
import itertools
import json
import multiprocessing
import os
import signal
import sys
import threading
import time
import zlib
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from zerotron.config.args import ArgumentParser
from zerotron.data.indexed_dataset import MMapIndexedDatasetBuilder, best_dtype
from zerotron.data.tokenizer import GPT2BPETokenizer, build_tokenizer
from zerotron.errors import ConfigError, DataError, UnsupportedError
from zerotron.progress import Progress

CHUNK_BYTES = 1 << 18  # raw input bytes per task: big enough to amortize IPC, small to balance
CHUNK_LINES = 4096
IN_FLIGHT_PER_WORKER = 4  # chunks queued per worker: keeps workers busy, bounds memory
SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")


# --------------------------------------------------------------------------- reading


@dataclass
class Chunk:
    """Consecutive raw lines of one input file, with where they start (for error messages)."""

    path: str
    first_line: int  # 1-based line number of lines[0]
    offset: int  # byte offset of lines[0] in the (uncompressed) file
    lines: list[bytes]
    position: int  # bytes of the input files consumed so far (compressed size for .gz)


def expand_inputs(patterns: Sequence[str]) -> list[Path]:
    """Files named by ``--input``: paths or glob patterns, each pattern's matches sorted."""
    paths: list[Path] = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not matches or not all(os.path.isfile(m) for m in matches):
            missing = next((m for m in matches if not os.path.isfile(m)), pattern)
            raise DataError(
                "no such input file" if matches else "the pattern matches no file",
                where=missing,
                fix="--input takes a .jsonl/.json/.jsonl.gz file or a glob such as 'dir/*.jsonl'",
            )
        for m in matches:
            if not m.endswith(SUFFIXES):
                raise DataError(
                    "unsupported input type",
                    where=m,
                    fix=f"inputs are JSON lines files ending in {', '.join(SUFFIXES)}",
                )
        paths += map(Path, matches)
    return paths


def read_chunks(paths: Sequence[Path]) -> Iterator[Chunk]:
    """Stream the raw lines of ``paths`` in order, grouped into :class:`Chunk` s."""
    done = 0
    for path in paths:
        with open(path, "rb") as raw:
            stream = gzip.GzipFile(fileobj=raw, mode="rb") if path.suffix == ".gz" else raw
            lines: list[bytes] = []
            size = 0
            first_line, offset = 1, 0
            for n, line in _numbered_lines(path, stream):
                if n == 1 and line.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark
                    line, offset = line[3:], 3
                lines.append(line)
                size += len(line)
                if size >= CHUNK_BYTES or len(lines) >= CHUNK_LINES:
                    yield Chunk(str(path), first_line, offset, lines, done + raw.tell())
                    first_line, offset = n + 1, offset + size
                    lines, size = [], 0
            if lines:
                yield Chunk(str(path), first_line, offset, lines, done + raw.tell())
            done += raw.tell()


def _numbered_lines(path: Path, stream) -> Iterator[tuple[int, bytes]]:
    """``(line number, line)`` of ``stream``; a damaged ``.gz`` becomes a DataError at its line.

    gzip reports damage as EOFError, zlib.error or BadGzipFile from deep inside the read, with
    no file name; the user needs the file, the line it got to, and how to check the file.
    """
    n = 0
    try:
        for n, line in enumerate(stream, 1):
            yield n, line
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise _gzip_error(path, n + 1, e) from None


def _gzip_error(path: Path, line: int, e: Exception) -> DataError:
    fix = f"check the file with `gzip -t {path}`; re-create or re-download it"
    if isinstance(e, EOFError):
        what = "the gzip file is truncated (it ends inside the compressed data)"
    elif isinstance(e, gzip.BadGzipFile) and line == 1:
        what = "not a gzip file, though its name ends in .gz"
        fix = "a plain JSON lines file must not end in .gz: rename it to .jsonl, or gzip it"
    else:
        what = f"corrupt gzip data ({e})"
    return DataError(what, where=f"{path}:{line}", fix=fix)


# --------------------------------------------------------------------------- encoding


@dataclass
class ChunkResult:
    """What a worker sends back for one chunk: per key, tokens and document lengths."""

    tokens: list[np.ndarray]
    lengths: list[np.ndarray]
    documents: int = 0  # valid lines
    empty: list[int] = field(default_factory=list)  # per key: documents with no tokens
    blank: int = 0  # whitespace-only lines
    invalid: int = 0
    error: DataError | None = None  # the first bad line, when not skipping them
    nbytes: int = 0
    position: int = 0


class Encoder:
    """Turns a chunk of raw JSON lines into token arrays (runs in the worker processes)."""

    def __init__(
        self,
        tokenizer: GPT2BPETokenizer,
        json_keys: Sequence[str],
        append_eod: bool,
        skip_invalid: bool,
    ):
        self.tokenizer = tokenizer
        self.keys = list(json_keys)
        self.append_eod = append_eod
        self.skip_invalid = skip_invalid
        self.dtype = best_dtype(tokenizer.vocab_size)

    def encode_chunk(self, chunk: Chunk) -> ChunkResult:
        keys = self.keys
        docs: list[list[list[int]]] = [[] for _ in keys]
        res = ChunkResult([], [], empty=[0] * len(keys), position=chunk.position)
        offset = chunk.offset
        for i, raw in enumerate(chunk.lines):
            line_offset, offset = offset, offset + len(raw)
            res.nbytes += len(raw)
            if not raw.strip():
                res.blank += 1
                continue
            try:
                texts = self._texts(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                at = line_offset + e.start
                texts = f"invalid UTF-8 at byte offset {at} of the file ({e.reason})"
            if isinstance(texts, str):  # what was wrong with the line
                if not self.skip_invalid:
                    where = f"{chunk.path}:{chunk.first_line + i}"
                    res.error = DataError(texts, where=where, fix=_FIX_INVALID)
                    break
                res.invalid += 1
                continue
            res.documents += 1
            for k, text in enumerate(texts):
                ids = self.tokenizer.tokenize(text)
                if not ids:
                    res.empty[k] += 1
                    continue
                if self.append_eod:
                    ids.append(self.tokenizer.eod)
                docs[k].append(ids)
        for doc_list in docs:
            lengths = np.fromiter(map(len, doc_list), dtype=np.int32, count=len(doc_list))
            total = int(lengths.sum(dtype=np.int64))
            flat = itertools.chain.from_iterable(doc_list)
            res.tokens.append(np.fromiter(flat, dtype=self.dtype, count=total))
            res.lengths.append(lengths)
        return res

    def _texts(self, line: str) -> list[str] | str:
        """The text under each key, or a message saying why the line is unusable."""
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            return f"malformed JSON: {e.msg} at column {e.colno}"
        except RecursionError:
            return "JSON nested too deeply to decode (arrays or objects inside each other)"
        except ValueError as e:  # e.g. an integer of more than 4300 digits
            return f"malformed JSON: {e}"
        if not isinstance(obj, dict):
            kind = type(obj).__name__
            hint = " (a JSON array must be written one object per line)" if kind == "list" else ""
            return f"expected a JSON object, got {kind}{hint}"
        texts = []
        for key in self.keys:
            if key not in obj:
                have = ", ".join(map(repr, list(obj)[:5])) or "none"
                return f"missing key {key!r} (keys on this line: {have})"
            value = obj[key]
            if not isinstance(value, str):
                return f"value of {key!r} is a {type(value).__name__}, expected a string"
            texts.append(value)
        return texts


_FIX_INVALID = "fix or remove the line, or pass --skip-invalid to skip and count such lines"
_WORKER_ENCODER: Encoder | None = None  # set once in each worker process by _init_worker


def _init_worker(encoder: Encoder) -> None:
    global _WORKER_ENCODER
    _WORKER_ENCODER = encoder
    # Ctrl-C goes to the whole process group; the parent alone decides how to stop. SIGTERM
    # (how the pool stops its workers) must kill at once, not run main()'s inherited handler.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _encode_in_worker(chunk: Chunk) -> ChunkResult:
    return _WORKER_ENCODER.encode_chunk(chunk)


@contextlib.contextmanager
def _default_sigterm() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def encode_chunks(chunks: Iterator[Chunk], encoder: Encoder, workers: int) -> Iterator[ChunkResult]:
    """Results of ``encoder.encode_chunk`` over ``chunks``, in order, on ``workers`` processes."""
    if workers <= 1:
        yield from map(encoder.encode_chunk, chunks)
        return
    with _default_sigterm():
        # Workers must be born with SIGTERM's default action: one that inherited main()'s
        # handler and was terminated before its initializer ran would ignore Pool.terminate().
        pool = multiprocessing.Pool(workers, initializer=_init_worker, initargs=(encoder,))
    with pool:
        # apply_async with a bounded queue rather than imap: imap reads its whole input ahead.
        pending: deque = deque()
        for chunk in chunks:
            pending.append(pool.apply_async(_encode_in_worker, (chunk,)))
            if len(pending) >= IN_FLIGHT_PER_WORKER * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


# --------------------------------------------------------------------------- progress


class _Progress:
    """Tokenizing progress: a bar over the input bytes on a terminal (:mod:`zerotron.progress`),
    else Megatron's ``Processed N documents (...)`` line every ``log_interval`` documents."""

    def __init__(self, total_bytes: int, log_interval: int, tty: bool):
        self.start = time.perf_counter()
        self.docs = self.nbytes = self.tokens = 0
        self.log_interval = log_interval
        self.next_log = log_interval
        self.bar = Progress(
            "tokenizing", total=max(total_bytes, 1), unit="bytes", tty=tty, log_seconds=None
        )

    def rates(self) -> str:
        dt = max(time.perf_counter() - self.start, 1e-9)
        return (
            f"{self.docs / dt:,.0f} docs/s, {self.nbytes / dt / 1e6:.2f} MB/s, "
            f"{self.tokens / dt:,.0f} tokens/s"
        )

    def update(self, docs: int, nbytes: int, tokens: int, position: int) -> None:
        self.docs += docs
        self.nbytes += nbytes
        self.tokens += tokens
        if self.bar.is_bar:
            self.bar.update(completed=position, info=self.rates())
        elif self.docs >= self.next_log:
            self.bar.note(f"Processed {self.docs:,} documents ({self.rates()}).")
            self.next_log = (self.docs // self.log_interval + 1) * self.log_interval

    def close(self) -> None:
        self.bar.close()


# --------------------------------------------------------------------------- the command


@dataclass
class PreprocessSummary:
    documents: int
    tokens: dict[str, int]  # per key
    empty: dict[str, int]  # per key
    invalid: int
    blank: int
    seconds: float
    outputs: list[str]  # prefixes written
    nbytes: int


def output_prefix_for(output_prefix: str | os.PathLike, key: str) -> str:
    """Megatron's output name: ``{prefix}_{key}_document``."""
    return f"{output_prefix}_{key}_document"


def preprocess(
    inputs: Sequence[str | os.PathLike],
    output_prefix: str | os.PathLike,
    tokenizer: GPT2BPETokenizer | None = None,
    json_keys: Sequence[str] = ("text",),
    append_eod: bool = False,
    workers: int = 1,
    log_interval: int = 1000,
    skip_invalid: bool = False,
    progress: bool | None = None,
) -> PreprocessSummary:
    """Tokenize JSON-lines ``inputs`` into one ``.bin/.idx`` pair per key. See module doc."""
    tokenizer = tokenizer or GPT2BPETokenizer()
    paths = expand_inputs([str(p) for p in inputs])
    encoder = Encoder(tokenizer, json_keys, append_eod, skip_invalid)
    prefixes = [output_prefix_for(output_prefix, k) for k in json_keys]
    tty = sys.stdout.isatty() if progress is None else progress
    bar = _Progress(sum(p.stat().st_size for p in paths), log_interval, tty)
    docs = invalid = blank = 0
    empty = [0] * len(json_keys)
    results = encode_chunks(read_chunks(paths), encoder, workers)
    try:
        with contextlib.ExitStack() as stack:
            builders = [
                stack.enter_context(MMapIndexedDatasetBuilder(p, encoder.dtype)) for p in prefixes
            ]
            for res in results:
                if res.error is not None:
                    raise res.error
                for builder, tokens, lengths in zip(builders, res.tokens, res.lengths):
                    builder.add_documents(tokens, lengths)
                docs += res.documents
                invalid += res.invalid
                blank += res.blank
                empty = [a + b for a, b in zip(empty, res.empty)]
                bar.update(res.documents, res.nbytes, sum(t.size for t in res.tokens), res.position)
            for key, builder, n_empty in zip(json_keys, builders, empty):
                if builder.num_documents == 0:
                    raise DataError(
                        f"no documents with text under key {key!r} "
                        f"({docs} valid lines, {n_empty} of them empty)",
                        where=", ".join(map(str, paths)),
                        fix="check --json-keys and the input files",
                    )
            tokens = {k: b.num_tokens for k, b in zip(json_keys, builders)}
    finally:
        results.close()  # stops the worker pool
        bar.close()
    return PreprocessSummary(
        documents=docs,
        tokens=tokens,
        empty=dict(zip(json_keys, empty)),
        invalid=invalid,
        blank=blank,
        seconds=time.perf_counter() - bar.start,
        outputs=prefixes,
        nbytes=bar.nbytes,
    )


def build_parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="zerotron preprocess",
        description="Tokenize loose JSON (one object per line) into Megatron .bin/.idx files: "
        "{output-prefix}_{key}_document.bin/.idx for each --json-keys key.",
    )
    g = p.add_argument_group("input data")
    g.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="JSON lines file(s) or glob(s): .jsonl, .json, .jsonl.gz",
    )
    g.add_argument(
        "--json-keys",
        nargs="+",
        default=["text"],
        help="keys to extract from each line; one output per key",
    )
    g.add_argument(
        "--split-sentences",
        action="store_true",
        help="(Megatron) split documents into sentences: not supported",
    )
    g.add_argument(
        "--keep-newlines",
        action="store_true",
        help="(Megatron) only meaningful with --split-sentences",
    )
    g.add_argument(
        "--skip-invalid",
        action="store_true",
        help="skip and count malformed lines instead of stopping",
    )
    g = p.add_argument_group("tokenizer")
    g.add_argument(
        "--tokenizer-type",
        default="GPT2BPETokenizer",
        help="GPT2BPETokenizer, or NullTokenizer (text is ids written out; needs --vocab-size)",
    )
    g.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="NullTokenizer's vocabulary: ids 0..N-1, end-of-document N",
    )
    g.add_argument(
        "--vocab-file",
        default=None,
        help="encoder.json / gpt2-vocab.json; unset: the packaged GPT-2 files",
    )
    g.add_argument(
        "--merge-file",
        default=None,
        help="vocab.bpe / gpt2-merges.txt; unset: the packaged GPT-2 files",
    )
    g.add_argument(
        "--tokenizer-json",
        default=None,
        help="a HuggingFace tokenizer.json for a GPT-2-style byte-level BPE",
    )
    g.add_argument(
        "--append-eod",
        action="store_true",
        help="append the end-of-document token to every document",
    )
    g = p.add_argument_group("output data")
    g.add_argument(
        "--output-prefix",
        required=True,
        help="path prefix of the outputs, without the _{key}_document suffix",
    )
    g.add_argument("--dataset-impl", default="mmap", help="(Megatron) only mmap exists")
    g = p.add_argument_group("runtime")
    g.add_argument(
        "--workers",
        type=int,
        default=_default_workers(),
        help="tokenizer processes (1: tokenize in this process)",
    )
    g.add_argument(
        "--partitions",
        type=int,
        default=1,
        help="(Megatron) accepted for compatibility; zerotron streams in one pass",
    )
    g.add_argument(
        "--log-interval",
        type=int,
        default=1000,
        help="documents between progress lines when not on a terminal",
    )
    return p


def _default_workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def _check_args(args) -> None:
    if args.split_sentences:
        raise UnsupportedError(
            "--split-sentences (NLTK sentence splitting, for BERT-style data) is not implemented",
            where="--split-sentences",
            fix="drop the flag: GPT pretraining uses whole documents",
        )
    if args.dataset_impl != "mmap":
        raise UnsupportedError(
            f"--dataset-impl {args.dataset_impl}: only Megatron's mmap format is written",
            where="--dataset-impl",
            fix="drop the flag (mmap is the default)",
        )
    for flag, value in (("--workers", args.workers), ("--log-interval", args.log_interval)):
        if value < 1:
            raise ConfigError(f"{flag} must be at least 1, got {value}", where=flag)
    if len(set(args.json_keys)) != len(args.json_keys):
        raise ConfigError(f"repeated key in {args.json_keys}", where="--json-keys")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _check_args(args)
    tokenizer = build_tokenizer(
        args.tokenizer_type,
        args.vocab_file,
        args.merge_file,
        args.tokenizer_json,
        vocab_size=args.vocab_size,
    )
    # `kill` (SIGTERM) unwinds like Ctrl-C, so temporary files are removed on the way out.
    in_main_thread = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGTERM, _raise_terminated) if in_main_thread else None
    try:
        s = preprocess(
            args.input,
            args.output_prefix,
            tokenizer,
            json_keys=args.json_keys,
            append_eod=args.append_eod,
            workers=args.workers,
            log_interval=args.log_interval,
            skip_invalid=args.skip_invalid,
        )
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, old)
    print(format_summary(s, tokenizer))
    return 0


def _raise_terminated(signum, frame):
    raise SystemExit(128 + signum)


def format_summary(s: PreprocessSummary, tokenizer: GPT2BPETokenizer) -> str:
    dt = max(s.seconds, 1e-9)
    total = sum(s.tokens.values())
    lines = [
        f"preprocessed {s.documents:,} documents, {total:,} tokens in {s.seconds:.1f} s "
        f"({s.documents / dt:,.0f} docs/s, {s.nbytes / dt / 1e6:.2f} MB/s, "
        f"{total / dt:,.0f} tokens/s)",
        f"  skipped: {sum(s.empty.values()):,} empty documents, {s.invalid:,} invalid lines, "
        f"{s.blank:,} blank lines",
    ]
    dtype = best_dtype(tokenizer.vocab_size)
    for (key, n), prefix in zip(s.tokens.items(), s.outputs):
        lines.append(
            f"  {key}: {n:,} tokens ({dtype}, {s.empty[key]:,} empty skipped) -> "
            f"{prefix}.bin, {prefix}.idx"
        )
    return "\n".join(lines)
