"""GPT pretraining samples from Megatron .bin/.idx data: datasets, splits, blends.

:class:`GPTDataset` serves ``num_samples`` samples of ``seq_length + 1`` tokens that run across
document boundaries (see :mod:`zerotron.data.index_builder` for the index arrays) as dicts of
tensors: ``tokens``, ``labels``, ``loss_mask``, ``position_ids`` and, with
``reset_attention_mask``, a per-sample ``attention_mask``. :func:`build_train_valid_test_datasets`
turns Megatron's ``--data-path`` / ``--split`` into the three datasets.

A *document* here is a document of the ``.idx`` (its ``doc_idx``), which may hold several
sequences when preprocessing split sentences; splits are made over documents.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zerotron.data import index_builder as ib
from zerotron.data.index_builder import (  # noqa: F401 (re-exported)
    DataPath,
    blend_weights,
    document_sizes,
    parse_data_path,
)
from zerotron.data.indexed_dataset import MMapIndexedDataset
from zerotron.errors import ConfigError, DataError

INDEX_KEYS = ("doc_idx", "sample_idx", "shuffle_idx")


def ltor_masks(
    tokens: np.ndarray,
    eod_token: int,
    *,
    eod_mask_loss: bool = False,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Megatron's left-to-right masks for one sample's input ``tokens``.

    Returns ``loss_mask`` (float32: 0 where the input token is EOD if ``eod_mask_loss``),
    ``position_ids`` (restarting at 0 after each EOD if ``reset_position_ids``) and, only if
    ``reset_attention_mask``, ``attention_mask`` ``[1, s, s]`` with True where query i may
    attend to key j: j <= i and no EOD in ``[j, i)``. An EOD belongs to the document it ends.
    """
    s = len(tokens)
    is_eod = tokens == eod_token
    loss_mask = np.ones(s, np.float32)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0
    arange = np.arange(s, dtype=np.int64)
    # Segment k starts right after the k-th EOD.
    starts = np.zeros(s, bool)
    starts[1:] = is_eod[:-1]
    if reset_position_ids:
        first = np.maximum.accumulate(np.where(starts, arange, 0))
        position_ids = arange - first
    else:
        position_ids = arange
    attention_mask = None
    if reset_attention_mask:
        segment = np.cumsum(starts)
        attention_mask = (segment[:, None] == segment[None, :]) & (arange[:, None] >= arange)
        attention_mask = attention_mask[None]
    return loss_mask, position_ids, attention_mask


class GPTDataset(torch.utils.data.Dataset):
    """``num_samples`` samples of ``seq_length + 1`` tokens from ``documents`` of one dataset.

    Args:
        indexed_dataset: the ``.bin/.idx`` reader.
        name: split name (``train``/``valid``/``test``), used in cache file names and messages.
        documents: document ids to draw from: a ``range`` (a split) or an array.
        num_samples: exactly this many samples; as many epochs as needed are built.
        seq_length: tokens per sample fed to the model (each sample reads one more).
        seed: shuffles documents per epoch and samples within each epoch.
        eod_token: the end-of-document id, for the masks below.
        eod_mask_loss, reset_position_ids, reset_attention_mask: Megatron's options.
        is_builder, barrier: see :func:`zerotron.data.index_builder.load_or_build`.
        cache_dir: where index caches go; default: the directory of the data.

    ``dataset[i]`` is a dict of tensors: ``tokens``, ``labels`` (int64 ``[s]``), ``loss_mask``
    (float32 ``[s]``), ``position_ids`` (int64 ``[s]``) and, only with ``reset_attention_mask``,
    ``attention_mask`` (bool ``[1, s, s]``, True = may attend). The object pickles by file
    names, so DataLoader workers reopen the memory maps instead of copying them.

    ``indexed_dataset`` may be anything with the reader's ``prefix``, ``num_documents``,
    ``sizes``, ``doc_idx``, ``get`` and ``document``; one with ``in_memory = True`` (mock data,
    :mod:`zerotron.data.mock`) gets its index arrays built in memory instead of cached on disk.
    """

    def __init__(
        self,
        indexed_dataset: MMapIndexedDataset,
        name: str,
        documents: range | Sequence[int] | np.ndarray,
        num_samples: int,
        seq_length: int,
        seed: int,
        *,
        eod_token: int,
        eod_mask_loss: bool = False,
        reset_position_ids: bool = False,
        reset_attention_mask: bool = False,
        is_builder: bool = True,
        barrier: Callable[[], None] | None = None,
        cache_dir: str | os.PathLike | None = None,
    ):
        if num_samples < 1 or seq_length < 1:
            raise ConfigError(
                f"{name}: need num_samples >= 1 and seq_length >= 1, "
                f"got {num_samples} and {seq_length}"
            )
        self.indexed_dataset = indexed_dataset
        self.name = name
        self.num_samples = int(num_samples)
        self.seq_length = int(seq_length)
        self.seed = int(seed)
        self.eod_token = int(eod_token)
        self.eod_mask_loss = eod_mask_loss
        self.reset_position_ids = reset_position_ids
        self.reset_attention_mask = reset_attention_mask

        prefix = indexed_dataset.prefix
        docs = _as_documents(documents, indexed_dataset.num_documents, name)
        self.description = {
            "class": "GPTDataset",
            "format": ib.INDEX_FORMAT,
            "dataset": prefix.name,
            "fingerprint": ib.fingerprint(indexed_dataset.sizes, indexed_dataset.doc_idx),
            "split": name,
            "documents": _describe_documents(docs),
            "num_samples": self.num_samples,
            "seq_length": self.seq_length,
            "seed": self.seed,
        }

        def build() -> dict[str, np.ndarray]:
            doc_sizes = document_sizes(indexed_dataset)
            if doc_sizes[docs].sum() == 0:
                raise DataError(
                    f"the {name} split has {len(docs)} documents but no tokens",
                    where=str(prefix),
                    fix="check the preprocessing output, or change --split",
                )
            return ib.build_gpt_indices(doc_sizes, docs, num_samples, seq_length, seed)

        if getattr(indexed_dataset, "in_memory", False):
            # Mock data (zerotron.data.mock): no files to cache next to; every rank builds.
            arrays, self._index_files, self.cache_hit = build(), {}, False
        else:
            arrays, self._index_files, self.cache_hit = ib.load_or_build(
                cache_dir if cache_dir is not None else prefix.parent,
                f"{prefix.name}_{name}",
                self.description,
                INDEX_KEYS,
                build,
                is_builder=is_builder,
                barrier=barrier,
            )
        self._set_arrays(arrays)

    def _set_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        self.doc_idx, self.sample_idx, self.shuffle_idx = (arrays[k] for k in INDEX_KEYS)
        if (
            self.sample_idx.shape != (self.num_samples + 1, 2)
            or self.shuffle_idx.shape != (self.num_samples,)
            or self.doc_idx.ndim != 1
        ):
            raise DataError(
                "index cache has the wrong shape",
                where=str(self._index_files["sample_idx"]),
                fix="delete the cache files named in this message and run again",
            )

    def __len__(self) -> int:
        return self.num_samples

    def tokens(self, idx: int) -> np.ndarray:
        """The ``seq_length + 1`` raw tokens of sample ``idx`` (in serving order)."""
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"sample {idx} out of range for {self.num_samples} samples")
        i = int(self.shuffle_idx[idx])
        first, first_off = (int(v) for v in self.sample_idx[i])
        last, last_off = (int(v) for v in self.sample_idx[i + 1])
        if first == last:
            return self._read(int(self.doc_idx[first]), first_off, last_off + 1 - first_off)
        parts = [self._read(int(self.doc_idx[first]), first_off, None)]
        parts += [self._read(int(d), 0, None) for d in self.doc_idx[first + 1 : last]]
        parts.append(self._read(int(self.doc_idx[last]), 0, last_off + 1))
        return np.concatenate(parts)

    def _read(self, doc: int, offset: int, length: int | None) -> np.ndarray:
        """Tokens ``offset : offset + length`` of document ``doc`` (to its end if None)."""
        ds = self.indexed_dataset
        lo, hi = int(ds.doc_idx[doc]), int(ds.doc_idx[doc + 1])
        if hi - lo == 1:
            return ds.get(lo, offset, length)
        whole = ds.document(doc)
        return whole[offset:] if length is None else whole[offset : offset + length]

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        sample = self.tokens(idx).astype(np.int64)
        tokens, labels = sample[:-1], sample[1:]
        loss_mask, position_ids, attention_mask = ltor_masks(
            tokens,
            self.eod_token,
            eod_mask_loss=self.eod_mask_loss,
            reset_position_ids=self.reset_position_ids,
            reset_attention_mask=self.reset_attention_mask,
        )
        out = {
            "tokens": torch.from_numpy(tokens.copy()),
            "labels": torch.from_numpy(labels.copy()),
            "loss_mask": torch.from_numpy(loss_mask),
            "position_ids": torch.from_numpy(position_ids.copy()),
        }
        if attention_mask is not None:
            out["attention_mask"] = torch.from_numpy(attention_mask)
        return out

    # Pickle by file names: a DataLoader worker reopens the memory maps.
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        if not self._index_files:  # built in memory over mock data: pickled whole
            return state
        state["indexed_dataset"] = str(self.indexed_dataset.prefix)
        for key in INDEX_KEYS:
            del state[key]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if not self._index_files:
            return
        self.indexed_dataset = MMapIndexedDataset(state["indexed_dataset"])
        self._set_arrays(
            {k: np.load(p, mmap_mode="r", allow_pickle=False) for k, p in self._index_files.items()}
        )


def gpt_collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack a list of sample dicts into a batch (``attention_mask`` becomes ``[b, 1, s, s]``)."""
    return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}


def _as_documents(documents, num_documents: int, name: str) -> np.ndarray:
    if isinstance(documents, range):
        docs = np.arange(documents.start, documents.stop, documents.step, dtype=np.int64)
    else:
        docs = np.asarray(documents, dtype=np.int64).reshape(-1)
    if docs.size and (docs.min() < 0 or docs.max() >= num_documents):
        raise DataError(f"{name}: document ids out of range for {num_documents} documents")
    if docs.size == 0:
        raise DataError(f"the {name} split has no documents", fix="change --split or add data")
    return docs


def _describe_documents(docs: np.ndarray) -> list[int] | str:
    """``[start, stop]`` for a contiguous range (the usual split), else a hash of the ids."""
    if docs.size and np.array_equal(docs, np.arange(docs[0], docs[0] + docs.size)):
        return [int(docs[0]), int(docs[0] + docs.size)]
    return "sha256:" + hashlib.sha256(docs.tobytes()).hexdigest()[:16]


# --------------------------------------------------------------------------- --data-path / --split


def check_split(
    ds: MMapIndexedDataset,
    split: str,
    index: int,
    doc_range: tuple[int, int],
    doc_sizes: np.ndarray | None = None,
    requested: Sequence[bool] = (True, True, True),
) -> None:
    """Raise a DataError if split ``index`` has no documents (or no tokens).

    The suggested ``--split`` gives a document to every split in ``requested``.
    """
    lo, hi = doc_range
    name = ib.SPLIT_NAMES[index]
    if hi > lo and (doc_sizes is None or doc_sizes[lo:hi].sum() > 0):
        return
    needed = [bool(r) or i == index for i, r in enumerate(requested)]
    suggestion = ib.suggest_split(ds.num_documents, needed)
    fix = (
        f"use --split {suggestion} or add data"
        if suggestion
        else f"add data: {ds.num_documents} documents cannot fill {sum(needed)} splits"
    )
    what = (
        f"{name} split has 0 of {ds.num_documents} documents with --split {split}"
        if hi == lo
        else f"{name} split has {hi - lo} documents but 0 tokens with --split {split}"
    )
    raise DataError(what + f", but {name} samples are requested", where=str(ds.prefix), fix=fix)


def build_train_valid_test_datasets(
    data_path: Sequence[str] | str | None,
    split: str,
    train_valid_test_num_samples: Sequence[int],
    seq_length: int,
    seed: int,
    *,
    per_split_paths: Sequence[Sequence[str] | str | None] | None = None,
    eod_token: int,
    eod_mask_loss: bool = False,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
    is_builder: bool = True,
    barrier: Callable[[], None] | None = None,
    cache_dir: str | os.PathLike | None = None,
    vocab_size: int | None = None,
) -> tuple[torch.utils.data.Dataset | None, ...]:
    """Train, valid and test datasets (None where 0 samples are requested).

    ``data_path`` is Megatron's ``--data-path`` (one prefix or a weighted blend), ``split`` its
    ``--split`` over documents, applied to each prefix of a blend. ``per_split_paths`` instead
    (Megatron's ``--train-data-path``, ``--valid-data-path``, ``--test-data-path``) gives each
    split its own prefix or blend, every document of it, and ``data_path`` and ``split`` are
    not used; a split without a path gets no dataset. Each dataset serves exactly the requested
    number of samples. Index files are built by the process with ``is_builder=True`` and loaded
    by the others after ``barrier()``. With ``vocab_size``, every token id of each dataset is
    checked to lie below it (a DataError naming the ``.bin`` and the offset otherwise); every
    rank checks, so all stop with the same error instead of waiting.
    """
    if len(train_valid_test_num_samples) != 3:
        raise ConfigError("need three sample counts: train, valid, test")
    for split_i, n in enumerate(train_valid_test_num_samples):
        if int(n) < 0:
            raise ConfigError(f"negative number of {ib.SPLIT_NAMES[split_i]} samples: {n}")
    requested = [int(n) > 0 for n in train_valid_test_num_samples]
    common = dict(
        seq_length=seq_length,
        seed=seed,
        eod_token=eod_token,
        eod_mask_loss=eod_mask_loss,
        reset_position_ids=reset_position_ids,
        reset_attention_mask=reset_attention_mask,
        is_builder=is_builder,
        barrier=barrier,
        cache_dir=cache_dir,
    )
    if per_split_paths is None:
        if data_path is None:
            raise ConfigError("no data path given", fix="--data-path PREFIX")
        data = _Source(data_path, vocab_size, split)
        return tuple(
            data.dataset(i, int(n), requested, **common) if n else None
            for i, n in enumerate(train_valid_test_num_samples)
        )
    if len(per_split_paths) != 3:
        raise ConfigError("need three per-split data paths (train, valid, test; None for none)")
    return tuple(
        _Source(path, vocab_size).dataset(i, int(n), requested, **common)
        if n and path is not None
        else None
        for i, (path, n) in enumerate(zip(per_split_paths, train_valid_test_num_samples))
    )


class _Source:
    """One ``--data-path``-style value opened: its indexed datasets and blend weights; cut by
    ``split`` into train/valid/test documents, or (``split`` None, a per-split path) used
    whole."""

    def __init__(
        self, data_path: Sequence[str] | str, vocab_size: int | None, split: str | None = None
    ):
        self.path = parse_data_path(data_path)
        self.indexed = [MMapIndexedDataset(p) for p in self.path.prefixes]
        if vocab_size is not None:
            for ds in self.indexed:
                ds.check_token_ids(vocab_size)
        self.split = split
        self.doc_sizes = [document_sizes(ds) for ds in self.indexed]
        self.weights = blend_weights(self.path, self.indexed) if self.path.is_blend else None

    def _documents(self, ds_i: int, split_i: int, requested: Sequence[bool]) -> range:
        ds = self.indexed[ds_i]
        if self.split is None:
            if self.doc_sizes[ds_i].sum() == 0:
                name = ib.SPLIT_NAMES[split_i]
                raise DataError(
                    f"the {name} data has no tokens, but {name} samples are requested",
                    where=str(ds.prefix),
                    fix=f"check --{name}-data-path",
                )
            return range(0, ds.num_documents)
        lo, hi = ib.split_ranges(self.split, ds.num_documents)[split_i]
        check_split(ds, self.split, split_i, (lo, hi), self.doc_sizes[ds_i], requested)
        return range(lo, hi)

    def dataset(
        self, split_i: int, n: int, requested: Sequence[bool], *, seq_length: int, seed: int,
        cache_dir: str | os.PathLike | None, is_builder: bool,
        barrier: Callable[[], None] | None, **masks: Any,
    ) -> torch.utils.data.Dataset:  # fmt: skip
        """Split ``split_i``'s dataset of ``n`` samples (blended when the path is a blend)."""
        from zerotron.data.blended_dataset import BlendedDataset

        name = ib.SPLIT_NAMES[split_i]
        build = dict(cache_dir=cache_dir, is_builder=is_builder, barrier=barrier, **masks)

        def one(ds_i: int, count: int) -> GPTDataset:
            docs = self._documents(ds_i, split_i, requested)
            return GPTDataset(self.indexed[ds_i], name, docs, count, seq_length, seed, **build)

        if self.weights is None:
            return one(0, n)
        return BlendedDataset.build(
            one,
            self.weights,
            n,
            name=name,
            description={
                "prefixes": [Path(p).name for p in self.path.prefixes],
                "fingerprints": [ib.fingerprint(d.sizes, d.doc_idx) for d in self.indexed],
                "split": self.split if self.split is not None else "whole",
                "seq_length": seq_length,
                "seed": seed,
            },
            cache_dir=cache_dir if cache_dir is not None else self.indexed[0].prefix.parent,
            is_builder=is_builder,
            barrier=barrier,
        )
