"""Mock data (Megatron's ``--mock-data``): synthetic documents, so a run needs no corpus.

:class:`MockIndexedDataset` stands where a ``.bin/.idx`` reader stands: it has the reader's
``sizes``, ``doc_idx``, ``get`` and ``document``, so the one :class:`~zerotron.data.gpt_dataset.
GPTDataset` builds its epochs, samples, shuffles and ``--split`` over it as over a corpus, and the
samplers slice its global batches over data-parallel ranks as usual. Every layout therefore reads
the very samples one process reads: runs of different layouts on mock data give the same losses.

As Megatron-core's ``MockGPTLowLevelDataset``: 100,000 documents of random lengths in
``[1, 4096)``, each a counting sequence closed by the end-of-document token (a model learns it,
so the loss falls as on text). Unlike Megatron's (fixed seed 0, every document ``1, 2, 3, ...``),
the lengths and each document's first token come from ``--seed``, and the count runs modulo the
vocabulary's non-EOD ids, so any vocabulary (a tiny test one too) holds every token. Tokens are
computed from their position when read: nothing is stored but two arrays of 100,000 numbers, and
the index arrays stay in memory (there is no data directory to cache them next to).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from zerotron.data import index_builder as ib
from zerotron.data.gpt_dataset import GPTDataset, check_split
from zerotron.errors import ConfigError

NUM_DOCUMENTS = 100_000
"""Documents in the mock corpus (Megatron-core's ``MockGPTLowLevelDataset.size``)."""

MAX_DOCUMENT_LENGTH = 4096
"""Document lengths are drawn from ``[1, MAX_DOCUMENT_LENGTH)`` (Megatron-core's bound)."""


class MockIndexedDataset:
    """Synthetic documents with the interface of :class:`~zerotron.data.indexed_dataset.
    MMapIndexedDataset` that :class:`~zerotron.data.gpt_dataset.GPTDataset` reads.

    Document ``d`` holds ``sizes[d]`` tokens: ``sizes[d] - 1`` ids counting up from
    ``starts[d]`` through the ``vocab_size - 1`` ids other than ``eod``, wrapping around, then
    ``eod``. One sequence per document (``doc_idx`` is ``0 .. n``).
    """

    in_memory = True
    """Index arrays over it are built in memory, not cached on disk (see GPTDataset)."""

    def __init__(
        self,
        vocab_size: int,
        eod: int,
        seed: int,
        num_documents: int = NUM_DOCUMENTS,
        max_length: int = MAX_DOCUMENT_LENGTH,
    ):
        if vocab_size < 2 or not 0 <= eod < vocab_size:
            raise ConfigError(
                f"mock data needs a vocabulary of at least 2 ids holding the EOD id, got "
                f"vocab_size {vocab_size}, eod {eod}",
                where="--mock-data",
            )
        if num_documents < 1 or max_length < 2:
            raise ConfigError(
                f"mock data needs documents: got {num_documents} of lengths below {max_length}"
            )
        self.vocab_size, self.eod, self.seed = int(vocab_size), int(eod), int(seed)
        self.prefix = Path(f"mock_seed{self.seed}")  # names the dataset in descriptions
        rng = np.random.default_rng([self.seed % 2**64, 2])  # streams 0 and 1 shuffle the splits
        self.sizes = rng.integers(1, max_length, size=num_documents, dtype=np.int32)
        self.starts = rng.integers(0, self.vocab_size - 1, size=num_documents, dtype=np.int64)
        self.doc_idx = np.arange(num_documents + 1, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def num_documents(self) -> int:
        return len(self.sizes)

    @property
    def num_tokens(self) -> int:
        return int(self.sizes.sum(dtype=np.int64))

    def check_token_ids(self, vocab_size: int) -> None:
        """Every id lies below ``self.vocab_size``; nothing to read to know it."""
        if self.vocab_size > vocab_size:
            raise ConfigError(f"mock vocabulary {self.vocab_size} exceeds {vocab_size}")

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``offset : offset + length`` of document ``idx`` (to its end if None)."""
        size = int(self.sizes[idx])
        stop = size if length is None else min(size, offset + length)
        pos = np.arange(offset, stop, dtype=np.int64)
        ids = (self.starts[idx] + pos) % (self.vocab_size - 1)
        ids += ids >= self.eod  # skip the EOD id: it only ever closes a document
        ids[pos == size - 1] = self.eod
        return ids

    def __getitem__(self, idx: int) -> np.ndarray:
        return self.get(idx)

    def document(self, d: int) -> np.ndarray:
        return self.get(d)


def build_mock_datasets(
    split: str,
    train_valid_test_num_samples: Sequence[int],
    seq_length: int,
    seed: int,
    *,
    vocab_size: int,
    eod_token: int,
    eod_mask_loss: bool = False,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
) -> tuple[torch.utils.data.Dataset | None, ...]:
    """Train, valid and test GPT datasets over mock documents (None where 0 samples are asked).

    The same arguments as :func:`~zerotron.data.gpt_dataset.build_train_valid_test_datasets`
    less the data path and caches: ``--split`` divides the mock documents as it divides a
    corpus's. Every rank builds the same datasets by itself (no barrier: nothing is written).
    """
    if len(train_valid_test_num_samples) != 3:
        raise ConfigError("need three sample counts: train, valid, test")
    ds = MockIndexedDataset(vocab_size, eod_token, seed)
    ranges = ib.split_ranges(split, ds.num_documents)
    requested = [int(n) > 0 for n in train_valid_test_num_samples]
    out: list[torch.utils.data.Dataset | None] = []
    for i, n in enumerate(int(n) for n in train_valid_test_num_samples):
        if n < 0:
            raise ConfigError(f"negative number of {ib.SPLIT_NAMES[i]} samples: {n}")
        if n == 0:
            out.append(None)
            continue
        lo, hi = ranges[i]
        check_split(ds, split, i, (lo, hi), ds.sizes, requested)
        out.append(
            GPTDataset(
                ds,  # type: ignore[arg-type]  (the reader's interface, see the class)
                ib.SPLIT_NAMES[i],
                range(lo, hi),
                n,
                seq_length,
                seed,
                eod_token=eod_token,
                eod_mask_loss=eod_mask_loss,
                reset_position_ids=reset_position_ids,
                reset_attention_mask=reset_attention_mask,
            )
        )
    return tuple(out)
