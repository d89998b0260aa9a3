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
        # np.memmap refuses empty files, so look at the size first.
        if os.path.getsize(idx_path) < HEADER.size:
            raise DataError(
                f"index file is truncated ({os.path.getsize(idx_path)} bytes, header alone "
                f"is {HEADER.size})",
                where=str(idx_path),
                fix="re-run the preprocessing that wrote it",
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
            raise DataError(f"unsupported index version {version}", where=str(idx_path))
        if code not in DTYPE_CODES:
            raise DataError(f"unknown dtype code {code}", where=str(idx_path))
        self.dtype = np.dtype(DTYPE_CODES[code])
        off = HEADER.size
        expect = off + n_seq * 4 + n_seq * 8 + n_doc * 8
        if len(self._index) < expect:
            raise DataError(
                f"index file is truncated ({len(self._index)} of {expect} bytes)",
                where=str(idx_path),
                fix="re-run the preprocessing that wrote it",
            )
        buf = self._index
        self.sizes = np.frombuffer(buf, dtype=np.int32, count=n_seq, offset=off)
        self.pointers = np.frombuffer(buf, dtype=np.int64, count=n_seq, offset=off + 4 * n_seq)
        self.doc_idx = np.frombuffer(buf, dtype=np.int64, count=n_doc, offset=off + 12 * n_seq)
        if n_doc < 1 or self.doc_idx[0] != 0 or self.doc_idx[-1] != n_seq:
            raise DataError(
                f"corrupt document index: {n_doc} entries, must run from 0 to {n_seq}",
                where=str(idx_path),
                fix="re-run the preprocessing that wrote it",
            )
        nbytes = os.path.getsize(bin_path)
        need = int(self.pointers[-1]) + int(self.sizes[-1]) * self.dtype.itemsize if n_seq else 0
        if nbytes < need:
            raise DataError(
                f"data file is truncated ({nbytes} of {need} bytes)",
                where=str(bin_path),
                fix="re-run the preprocessing that wrote it",
            )
        # np.memmap refuses empty files; an empty dataset is still a valid dataset.
        self._bin = (
            np.memmap(bin_path, dtype=np.uint8, mode="r") if nbytes else np.zeros(0, np.uint8)
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
