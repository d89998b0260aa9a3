"""Megatron-LM's MMapIndexedDataset format: ``P.bin`` (tokens) + ``P.idx`` (index), bit for bit.

``.idx`` layout (little-endian)::

    b"MMIDIDX\\x00\\x00"        9-byte magic
    <Q version = 1
    <B dtype code               1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64,
                                7 float32, 8 uint16
    <Q sequence count  S
    <Q document count  D        (= number of documents + 1: doc_idx starts with 0)
    int32[S]  sequence lengths (in tokens)
    int64[S]  byte offset of each sequence in .bin
    int64[D]  doc_idx: index of the first sequence of each document, then S

Both files are read through memory maps, so opening a 100 GB dataset costs nothing.
Writing goes through temporary names; the ``.idx`` is renamed into place last, so an
interrupted write never leaves a pair that looks complete.
"""

from __future__ import annotations

import contextlib
import os
import struct
from array import array
from pathlib import Path

import numpy as np

from zerotron.errors import DataError
from zerotron.fileio import commit, disk_full_is_clear, temp_path

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES: dict[int, type[np.generic]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
CODE_OF = {np.dtype(t): c for c, t in DTYPE_CODES.items()}
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count
FIX_REBUILD = "re-run the `zerotron preprocess` (or merge-datasets) that wrote it"
CHECK_CHUNK = 1 << 24  # entries (or tokens) per vectorized step of the checks: bounds memory


def best_dtype(vocab_size: int) -> np.dtype:
    """Megatron's choice: uint16 tokens when the vocabulary fits (under 65500), else int32."""
    return (
        np.dtype(np.uint16) if vocab_size is not None and vocab_size < 65500 else np.dtype(np.int32)
    )


def data_file(prefix: str | os.PathLike) -> Path:
    return Path(f"{prefix}.bin")


def index_file(prefix: str | os.PathLike) -> Path:
    return Path(f"{prefix}.idx")


def exists(prefix: str | os.PathLike) -> bool:
    return data_file(prefix).is_file() and index_file(prefix).is_file()


def encode_index(dtype: np.dtype, sizes: np.ndarray, doc_idx: np.ndarray) -> bytes:
    """The whole ``.idx`` file for ``sizes`` (tokens per sequence) and ``doc_idx``."""
    dtype = np.dtype(dtype)
    sizes = np.asarray(sizes, dtype=np.int32)
    pointers = np.zeros(len(sizes), dtype=np.int64)
    if len(sizes) > 1:
        np.cumsum(sizes[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    doc_idx = np.asarray(doc_idx, dtype=np.int64)
    head = HEADER.pack(MAGIC, VERSION, CODE_OF[dtype], len(sizes), len(doc_idx))
    return head + sizes.tobytes() + pointers.tobytes() + doc_idx.tobytes()


def check_sequences(
    idx_path: Path, sizes: np.ndarray, pointers: np.ndarray, itemsize: int, nbytes: int
) -> None:
    """Raise a DataError at the first sequence whose size or pointer cannot be right.

    Megatron writes sequences back to back from byte 0, so each pointer must be where the
    previous sequence ends and no size may be negative. A damaged entry in the middle would
    otherwise pass: ``dataset-info`` would report negative or impossible token counts and
    training would read garbage. Vectorized, in pieces. ``nbytes`` (the ``.bin`` length) only
    helps tell a damaged size from a damaged pointer; the caller compares it with the end.
    """
    start = 0  # where the next sequence must begin
    for lo in range(0, len(sizes), CHECK_CHUNK):
        s = sizes[lo : lo + CHECK_CHUNK].astype(np.int64)
        p = pointers[lo : lo + CHECK_CHUNK]
        ends = start + np.cumsum(s * itemsize)
        bad = s < 0
        bad[0] |= p[0] != start
        bad[1:] |= p[1:] != ends[:-1]
        if bad.any():
            raise _sequence_error(
                idx_path, sizes, pointers, lo + int(np.argmax(bad)), itemsize, nbytes
            )
        start = int(ends[-1])


def _sequence_error(
    idx_path: Path, sizes: np.ndarray, pointers: np.ndarray, i: int, itemsize: int, nbytes: int
) -> DataError:
    """Say what is wrong with entry ``i``, the first bad one: its size, or the size before it, or
    its pointer (a pointer that agrees with the sequence after it is taken as right)."""
    n = len(sizes)
    size, pointer = int(sizes[i]), int(pointers[i])
    prev_end = int(pointers[i - 1]) + int(sizes[i - 1]) * itemsize if i else 0
    next_start = int(pointers[i + 1]) if i + 1 < n else nbytes
    if size < 0:
        at, what = i, f"negative size {size:,} tokens"
    elif i and next_start - pointer == size * itemsize:
        gap = pointer - int(pointers[i - 1])
        at = i - 1
        what = (
            f"size {int(sizes[i - 1]):,} tokens, but the next sequence starts {gap:,} bytes "
            f"after it ({gap / itemsize:,.0f} tokens)"
        )
    else:
        at, what = (
            i,
            f"pointer {pointer:,} should be {prev_end:,} (where the sequence before it ends)",
        )
    return DataError(
        f"sequence {at:,} of {n:,}: {what}",
        where=str(idx_path),
        fix="the index is damaged: " + FIX_REBUILD,
    )


def check_doc_idx(idx_path: Path, doc_idx: np.ndarray, num_sequences: int) -> None:
    """Raise a DataError at the first document-index entry that is out of range or out of order.

    ``doc_idx`` runs from 0 to the sequence count without going back; an entry outside that
    range would make a document start in another dataset's memory or end before it begins.
    """
    n = len(doc_idx)
    if n < 1 or doc_idx[0] != 0 or doc_idx[-1] != num_sequences:
        first, last = (int(doc_idx[0]), int(doc_idx[-1])) if n else (None, None)
        raise DataError(
            f"corrupt document index: {n:,} entries from {first} to {last}, "
            f"must run from 0 to {num_sequences:,}",
            where=str(idx_path),
            fix="the index is damaged: " + FIX_REBUILD,
        )
    for lo in range(0, n, CHECK_CHUNK):
        d = doc_idx[lo : lo + CHECK_CHUNK + 1]  # one more: the step to the next piece
        out = (d < 0) | (d > num_sequences)
        back = np.concatenate((np.diff(d) < 0, [False]))
        bad = out | np.roll(back, 1)
        if bad.any():
            i = int(np.argmax(bad))
            what = (
                f"is {int(d[i]):,}, outside [0, {num_sequences:,}]"
                if out[i]
                else f"is {int(d[i]):,}, less than the entry before it ({int(d[i - 1]):,})"
            )
            raise DataError(
                f"corrupt document index: entry {lo + i:,} of {n:,} {what}",
                where=str(idx_path),
                fix="the index is damaged: " + FIX_REBUILD,
            )


class MMapIndexedDatasetBuilder:
    """Streams sequences into ``prefix.bin``; :meth:`finalize` writes ``prefix.idx``.

    Memory is O(number of sequences) for the index (4 bytes each), never O(tokens).
    Use as a context manager: leaving the block by an exception removes the temporary files.
    """

    def __init__(self, prefix: str | os.PathLike, dtype: np.dtype | type = np.uint16):
        self.prefix = Path(prefix)
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF:
            raise DataError(f"unsupported token dtype {self.dtype}", where=str(prefix))
        self._tmp_bin = temp_path(data_file(prefix))
        self._bin = open(self._tmp_bin, "wb")
        self._sizes = array("i")
        self._doc_idx = array("q", [0])
        self.num_tokens = 0

    def add_item(self, tokens) -> None:
        """Append one sequence (a 1-D array or list of token ids)."""
        arr = np.asarray(tokens, dtype=self.dtype)
        with disk_full_is_clear(self._tmp_bin):
            self._bin.write(arr.tobytes(order="C"))
        self._sizes.append(arr.size)
        self.num_tokens += arr.size

    @property
    def num_documents(self) -> int:
        """Documents completed so far."""
        return len(self._doc_idx) - 1

    def end_document(self) -> None:
        self._doc_idx.append(len(self._sizes))

    def add_document(self, tokens, lengths: list[int] | None = None) -> None:
        """Append a document made of one sequence, or of several with the given lengths."""
        if lengths is None:
            self.add_item(tokens)
        else:
            arr = np.asarray(tokens, dtype=self.dtype)
            start = 0
            for n in lengths:
                self.add_item(arr[start : start + n])
                start += n
        self.end_document()

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append many one-sequence documents at once: ``tokens`` concatenated, ``lengths`` each.

        The fast path of preprocessing: one write and two array extends per batch.
        """
        tokens = np.ascontiguousarray(tokens, dtype=self.dtype)
        lengths = np.ascontiguousarray(lengths, dtype=np.int32)
        if int(lengths.sum(dtype=np.int64)) != tokens.size:
            raise ValueError(f"lengths sum to {lengths.sum()}, but there are {tokens.size} tokens")
        with disk_full_is_clear(self._tmp_bin):
            self._bin.write(tokens.data)
        first = len(self._sizes)
        self._sizes.frombytes(lengths.tobytes())
        self._doc_idx.extend(range(first + 1, first + 1 + lengths.size))
        self.num_tokens += tokens.size

    def add_index(self, prefix: str | os.PathLike) -> None:
        """Append a whole existing dataset (used by merge-datasets)."""
        other = MMapIndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise DataError(
                f"dtype {other.dtype} differs from {self.dtype} of the other inputs",
                where=str(index_file(prefix)),
                fix="merge only datasets tokenized with the same vocabulary size",
            )
        offset = len(self._sizes)
        self._sizes.extend(other.sizes.tolist())
        self._doc_idx.extend((other.doc_idx[1:] + offset).tolist())
        with disk_full_is_clear(self._tmp_bin), open(data_file(prefix), "rb") as f:
            while chunk := f.read(1 << 24):
                self._bin.write(chunk)
        self.num_tokens += int(other.sizes.sum(dtype=np.int64))

    def finalize(self) -> None:
        """Write the index and move both files into place (the ``.idx`` last)."""
        idx_final, bin_final = index_file(self.prefix), data_file(self.prefix)
        self._bin.close()
        tmp_idx = temp_path(idx_final)
        try:
            with disk_full_is_clear(tmp_idx), open(tmp_idx, "wb") as f:
                f.write(
                    encode_index(
                        self.dtype,
                        np.frombuffer(self._sizes, np.int32),
                        np.frombuffer(self._doc_idx, np.int64),
                    )
                )
            # An old .idx must not be paired with the new .bin, even for a moment.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(idx_final)
            commit(self._tmp_bin, bin_final)
            commit(tmp_idx, idx_final)
        finally:
            self._cleanup(tmp_idx)

    def abort(self) -> None:
        self._bin.close()
        self._cleanup()

    def _cleanup(self, *extra: Path) -> None:
        for p in (self._tmp_bin, *extra):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)

    def __enter__(self) -> MMapIndexedDatasetBuilder:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._bin.closed:
            self.finalize()


class MMapIndexedDataset:
    """Read-only view of a ``.bin/.idx`` pair through memory maps.

    ``ds[i]`` is sequence ``i`` as a numpy array; ``ds.get(i, offset, length)`` a slice of it
    without reading the rest. ``sizes`` (int32) and ``doc_idx`` (int64) are memory-mapped too.
    """

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = Path(prefix)
        idx_path, bin_path = index_file(prefix), data_file(prefix)
        for p in (idx_path, bin_path):
            if not p.is_file():
                raise DataError(
                    "file not found",
                    where=str(p),
                    fix="pass the prefix without .bin/.idx, e.g. my-corpus_text_document; "
                    "make it with `zerotron preprocess`",
                )
        nbytes = os.path.getsize(bin_path)
        self._open_index(idx_path)
        check_sequences(idx_path, self.sizes, self.pointers, self.dtype.itemsize, nbytes)
        check_doc_idx(idx_path, self.doc_idx, len(self.sizes))
        self._check_data_end(idx_path, bin_path, nbytes)
        # np.memmap refuses empty files; an empty dataset is still a valid dataset.
        self._bin = (
            np.memmap(bin_path, dtype=np.uint8, mode="r") if nbytes else np.zeros(0, np.uint8)
        )

    def _open_index(self, idx_path: Path) -> None:
        """Map the ``.idx`` and check its header and length (sizes, pointers and doc_idx views)."""
        have = os.path.getsize(idx_path)
        # np.memmap refuses empty files, so look at the size first.
        if have < HEADER.size:
            raise DataError(
                f"index file is truncated ({have} bytes, header alone is {HEADER.size})",
                where=str(idx_path),
                fix=FIX_REBUILD,
            )
        self._index = np.memmap(idx_path, dtype=np.uint8, mode="r")
        magic, version, code, n_seq, n_doc = HEADER.unpack(self._index[: HEADER.size].tobytes())
        if magic != MAGIC:
            raise DataError(
                f"not a Megatron MMIDIDX index (magic {magic!r})",
                where=str(idx_path),
                fix="re-run `zerotron preprocess` (legacy 'cached'/'lazy' formats are not read)",
            )
        if version != VERSION:
            raise DataError(
                f"unsupported index version {version} (only version {VERSION} exists)",
                where=str(idx_path),
                fix=FIX_REBUILD,
            )
        if code not in DTYPE_CODES:
            raise DataError(
                f"unknown dtype code {code} (known: {sorted(DTYPE_CODES)})",
                where=str(idx_path),
                fix=FIX_REBUILD,
            )
        self.dtype = np.dtype(DTYPE_CODES[code])
        off = HEADER.size
        expect = off + n_seq * 4 + n_seq * 8 + n_doc * 8
        if have < expect:
            raise DataError(
                f"index file is truncated ({have} of {expect} bytes): its header announces "
                f"{n_seq:,} sequences and {n_doc:,} document-index entries",
                where=str(idx_path),
                fix=FIX_REBUILD,
            )
        buf = self._index
        self.sizes = np.frombuffer(buf, dtype=np.int32, count=n_seq, offset=off)
        self.pointers = np.frombuffer(buf, dtype=np.int64, count=n_seq, offset=off + 4 * n_seq)
        self.doc_idx = np.frombuffer(buf, dtype=np.int64, count=n_doc, offset=off + 12 * n_seq)

    def _check_data_end(self, idx_path: Path, bin_path: Path, nbytes: int) -> None:
        """The index must describe exactly the bytes of the ``.bin``: neither more nor fewer."""
        need = self._data_end()
        if nbytes == need:
            return
        last = int(self.sizes[-1]) * self.dtype.itemsize if len(self.sizes) else 0
        # The last sequence starts inside the .bin but is longer than all of it: a bad size.
        if last > nbytes and int(self.pointers[-1]) < nbytes:
            raise DataError(
                f"sequence {len(self.sizes) - 1:,} of {len(self.sizes):,}: size "
                f"{int(self.sizes[-1]):,} tokens ({last:,} bytes) is more than the .bin holds "
                f"({nbytes:,} bytes)",
                where=str(idx_path),
                fix="the index is damaged: " + FIX_REBUILD,
            )
        raise DataError(
            f"data file is truncated ({nbytes:,} of {need:,} bytes)"
            if nbytes < need
            else f"data file has {nbytes:,} bytes but its index describes only {need:,}",
            where=str(bin_path),
            fix="the .bin and .idx must be written together: " + FIX_REBUILD,
        )

    def _data_end(self) -> int:
        """Bytes of ``.bin`` the index describes (valid once :func:`check_sequences` passed)."""
        if not len(self.sizes):
            return 0
        return int(self.pointers[-1]) + int(self.sizes[-1]) * self.dtype.itemsize

    def check_token_ids(self, vocab_size: int) -> None:
        """Raise a DataError naming the first token id outside ``[0, vocab_size)``.

        Such an id (a ``.bin`` made with another vocabulary, or damaged) would otherwise surface
        as an IndexError deep in the embedding, with no file or offset. One vectorized pass over
        the ``.bin`` in pieces of 16 Mi tokens: about a second per few GB from the page cache.
        """
        tokens = self._bin.view(self.dtype)
        for lo in range(0, len(tokens), CHECK_CHUNK):
            part = tokens[lo : lo + CHECK_CHUNK]
            if part.max() < vocab_size and part.min() >= 0:
                continue
            at = lo + int(np.argmax((part >= vocab_size) | (part < 0)))
            raise self._bad_token(at, int(tokens[at]), vocab_size)

    def _bad_token(self, at: int, value: int, vocab_size: int) -> DataError:
        offset = at * self.dtype.itemsize
        seq = int(np.searchsorted(self.pointers, offset, side="right")) - 1
        doc = int(np.searchsorted(self.doc_idx, seq, side="right")) - 1
        return DataError(
            f"token id {value} at byte offset {offset:,} (token {at:,}, sequence {seq:,}, "
            f"document {doc:,}) is outside the vocabulary of {vocab_size:,} ids",
            where=str(data_file(self.prefix)),
            fix="tokenize the corpus with the tokenizer this model uses (`zerotron preprocess` "
            "with the same --vocab-file/--merge-file or --tokenizer-json); if it was, the .bin "
            "is damaged: " + FIX_REBUILD,
        )

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def num_documents(self) -> int:
        return len(self.doc_idx) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sizes.sum(dtype=np.int64))

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``offset : offset + length`` of sequence ``idx``."""
        size = int(self.sizes[idx])
        if length is None:
            length = size - offset
        start = int(self.pointers[idx]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, dtype=self.dtype, count=length, offset=start)

    def __getitem__(self, idx: int) -> np.ndarray:
        return self.get(idx)

    def document(self, d: int) -> np.ndarray:
        """All tokens of document ``d`` (its sequences concatenated)."""
        lo, hi = int(self.doc_idx[d]), int(self.doc_idx[d + 1])
        if hi - lo == 1:
            return self.get(lo)
        return (
            np.concatenate([self.get(i) for i in range(lo, hi)])
            if hi > lo
            else np.zeros(0, self.dtype)
        )
