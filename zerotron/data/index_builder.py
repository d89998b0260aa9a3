"""The index arrays behind GPT and blended datasets, and their ``.npy`` cache.

A GPT dataset reads fixed-length samples out of a stream of documents. Three arrays describe
that stream (Megatron-LM's names):

``doc_idx``
    The documents of the split, one shuffled permutation per epoch, epochs one after another.
    The stream is the concatenation of these documents' tokens.
``sample_idx``
    ``[num_samples + 1, 2]`` pairs (position in ``doc_idx``, token offset in that document).
    Sample ``i`` is the ``seq_length + 1`` tokens from stream position ``i * seq_length``
    through ``(i + 1) * seq_length`` inclusive: consecutive samples share one token, so the
    label of a sample's last input is the next sample's first input.
``shuffle_idx``
    The order samples are served in: a permutation *within* each epoch's samples (a sample
    belongs to the epoch its first token comes from), so every epoch is seen completely before
    the next one begins and each token is an input exactly once per epoch.

Each epoch gets its own document permutation (Megatron shuffles all epochs together and then
needs its "separate last epoch" fix); as many epochs are built as the requested number of
samples needs, so a tiny corpus never runs dry.

Blends use :func:`build_blending_indices`. Everything is vectorized numpy except the blend loop
for three or more datasets, which is inherently sequential (see there).

Caches are written by one rank and read by all: :func:`load_or_build`. The torch-free parsing
of Megatron's ``--split`` and ``--data-path`` lives here too, for ``zerotron dataset-info``.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from zerotron.config.sections import data as config_data
from zerotron.data.indexed_dataset import MMapIndexedDataset
from zerotron.errors import ConfigError, DataError
from zerotron.fileio import atomic_open, atomic_write_text

log = logging.getLogger(__name__)

SPLIT_NAMES = ("train", "valid", "test")
INDEX_FORMAT = 1  # bump when the meaning of the cached arrays changes


# --------------------------------------------------------------------------- splits


def parse_split(split: str) -> list[float]:
    """``"949,50,1"`` (or ``"98/2/0"``, or fewer numbers) -> three weights summing to 1."""
    return list(config_data.parse_split(str(split)))


def split_ranges(split: str, num_documents: int) -> list[tuple[int, int]]:
    """Document ranges ``[start, stop)`` of train, valid and test (Megatron's rounding).

    Each boundary is the rounded cumulative share; any rounding surplus or deficit is taken
    from the boundaries after the first, so the last range always ends at ``num_documents``.
    """
    bounds = [0]
    for share in parse_split(split):
        bounds.append(bounds[-1] + int(round(share * float(num_documents))))
    diff = bounds[-1] - num_documents
    bounds = [bounds[0]] + [b - diff for b in bounds[1:]]
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


def suggest_split(num_documents: int, needed: Sequence[bool]) -> str | None:
    """A ``--split`` that gives every split in ``needed`` at least one document, if any does."""
    if num_documents < sum(needed):
        return None
    for share in (1, 2, 5, 10, 20, 25, 33):
        parts = [100 - share * (sum(needed[1:])), *(share if n else 0 for n in needed[1:])]
        if parts[0] <= 0:
            continue
        text = ",".join(str(p) for p in parts)
        ranges = split_ranges(text, num_documents)
        if all(hi > lo for (lo, hi), n in zip(ranges, needed) if n):
            return text
    return None


# --------------------------------------------------------------------------- GPT indices


def num_epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Fewest epochs whose tokens hold ``num_samples`` samples of ``seq_length + 1`` tokens."""
    if tokens_per_epoch <= 0:
        raise DataError("cannot draw samples from a split with no tokens")
    # Samples overlap by one token: N samples span N * seq_length + 1 tokens.
    return -(-(num_samples * seq_length + 1) // tokens_per_epoch)


def index_dtype(max_value: int) -> np.dtype:
    """int32 when every value fits (halves the cache), else int64."""
    return np.dtype(np.int32) if max_value < 2**31 - 1 else np.dtype(np.int64)


def build_doc_idx(documents: np.ndarray, num_epochs: int, rng: np.random.Generator) -> np.ndarray:
    """``num_epochs`` independent permutations of ``documents``, concatenated."""
    documents = np.asarray(documents)
    dtype = index_dtype(int(documents.max(initial=0)))
    epochs = np.broadcast_to(documents.astype(dtype), (num_epochs, len(documents)))
    return rng.permuted(epochs, axis=1).reshape(-1)


def build_sample_idx(
    doc_sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, num_samples: int
) -> np.ndarray:
    """``[num_samples + 1, 2]`` (doc_idx position, offset) of stream positions ``i * seq_length``.

    ``doc_sizes[d]`` is the token count of document ``d``. A position is placed in the document
    that holds that token (empty documents never hold one), so offsets are always valid.
    """
    ends = np.cumsum(doc_sizes[doc_idx], dtype=np.int64)  # stream position after each document
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    if ends.size == 0 or starts[-1] >= ends[-1]:
        raise DataError(f"{num_samples} samples need more tokens than the document index holds")
    pos = np.searchsorted(ends, starts, side="right")
    offset = starts - (ends[pos] - doc_sizes[doc_idx[pos]])
    dtype = index_dtype(max(len(doc_idx), int(doc_sizes.max(initial=0))))
    return np.stack([pos, offset], axis=1).astype(dtype)


def build_shuffle_idx(
    num_samples: int, seq_length: int, tokens_per_epoch: int, rng: np.random.Generator
) -> np.ndarray:
    """A permutation of ``range(num_samples)`` that shuffles only within each epoch's samples."""
    samples = np.arange(num_samples, dtype=np.int64)
    epoch = samples * seq_length // tokens_per_epoch  # already sorted: epochs are contiguous
    # Unique keys (epoch major, a random permutation minor) make any sort give the same order.
    if int(epoch[-1]) < (2**63 - 1) // max(num_samples, 1) - 1:
        order = np.argsort(epoch * num_samples + rng.permutation(num_samples))
    else:  # astronomically many epochs: a slower but overflow-free two-key sort
        order = np.lexsort((rng.permutation(num_samples), epoch))
    dtype = np.dtype(np.uint32) if num_samples < 2**32 - 1 else np.dtype(np.int64)
    return order.astype(dtype)


def build_gpt_indices(
    doc_sizes: np.ndarray,
    documents: np.ndarray,
    num_samples: int,
    seq_length: int,
    seed: int,
) -> dict[str, np.ndarray]:
    """``doc_idx``, ``sample_idx`` and ``shuffle_idx`` for ``num_samples`` samples.

    ``doc_sizes`` holds the token count of every document of the dataset; ``documents`` the ids
    of the documents this dataset draws from (one split).
    """
    if num_samples < 1 or seq_length < 1:
        raise ConfigError(
            f"need num_samples >= 1 and seq_length >= 1, got {num_samples}, {seq_length}"
        )
    tokens_per_epoch = int(doc_sizes[documents].sum(dtype=np.int64))
    num_epochs = num_epochs_needed(tokens_per_epoch, seq_length, num_samples)
    seed %= 2**64  # SeedSequence takes non-negative integers only
    doc_rng = np.random.default_rng([seed, 0])
    shuffle_rng = np.random.default_rng([seed, 1])
    doc_idx = build_doc_idx(documents, num_epochs, doc_rng)
    sample_idx = build_sample_idx(doc_sizes, doc_idx, seq_length, num_samples)
    # The tail of the last epoch that no sample reaches is dead weight on disk.
    doc_idx = doc_idx[: int(sample_idx[-1, 0]) + 1]
    shuffle_idx = build_shuffle_idx(num_samples, seq_length, tokens_per_epoch, shuffle_rng)
    return {"doc_idx": doc_idx, "sample_idx": sample_idx, "shuffle_idx": shuffle_idx}


# --------------------------------------------------------------------------- blends


def normalize_weights(weights: Sequence[float]) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or w.size == 0 or not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise ConfigError(
            f"blend weights must be positive numbers, got {list(weights)}",
            fix="--data-path 0.3 PREFIX_A 0.7 PREFIX_B (drop a dataset rather than weight it 0)",
        )
    return w / w.sum()


def build_blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Which dataset (and which of its samples) serves each of ``size`` blended samples.

    Returns ``dataset_index`` (uint8 or int16) and ``dataset_sample_index`` (int64: the k-th
    time dataset d is chosen it serves its sample k).

    Megatron picks, at each step, the dataset with the largest ``weight * step - count``. That
    greedy rule can let a dataset's count drift more than one sample from ``weight * n`` with
    three or more datasets. We use Tijdeman's earliest-deadline rule instead (the "chairman
    assignment problem", 1980): with ``s = 1 / (2K - 2)``, at step t choose, among datasets with
    ``weight * t - count >= s``, the one whose next deadline ``(count + 1 - s) / weight`` comes
    first. It guarantees ``|count_d(n) - weight_d * n| <= 1 - s < 1`` for every prefix n.

    For two datasets (s = 1/2) the rule is a merge of the two sequences ``(j + 1/2) / weight``,
    done with one sort; for more it is a plain Python loop (~0.6 us a step), whose result the
    caller caches.
    """
    w = normalize_weights(weights)
    k = len(w)
    dtype = np.dtype(np.uint8) if k < 256 else np.dtype(np.int16)
    if k == 1:
        index = np.zeros(size, dtype)
    elif k == 2:
        index = _blend_two(w, size).astype(dtype)
    else:
        index = np.frombuffer(_blend_loop(w, size), dtype=np.int32).astype(dtype)
    sample = np.empty(size, np.int64)
    for d in range(k):
        hit = index == d
        sample[hit] = np.arange(int(hit.sum()), dtype=np.int64)
    return index, sample


def _deadline(count: np.ndarray | float, sigma: float, inv_weight: float) -> np.ndarray | float:
    # One formula for both paths, so the sort and the loop agree bit for bit.
    return (count + (1.0 - sigma)) * inv_weight


def _blend_two(w: np.ndarray, size: int) -> np.ndarray:
    """Two datasets: the earliest-deadline schedule is the merged order of the deadlines."""
    stamps, owner = [], []
    for d in range(2):
        j = np.arange(math.ceil(w[d] * size) + 2, dtype=np.float64)
        stamps.append(_deadline(j, 0.5, 1.0 / w[d]))
        owner.append(np.full(j.size, d, np.int8))
    stamps_all, owner_all = np.concatenate(stamps), np.concatenate(owner)
    # Stable: on equal deadlines dataset 0 goes first, as in the loop.
    order = np.argsort(stamps_all, kind="stable")[:size]
    return owner_all[order]


def _blend_loop(w: np.ndarray, size: int) -> bytearray:
    k = len(w)
    sigma = 1.0 / (2 * k - 2)
    inv = [1.0 / float(x) for x in w]
    count = [0] * k
    release = [sigma * inv[d] for d in range(k)]  # earliest step dataset d may be chosen again
    deadline = [_deadline(0, sigma, inv[d]) for d in range(k)]
    out = bytearray(4 * size)
    view = memoryview(out).cast("i")
    datasets = range(k)
    for n in range(size):
        t = n + 1 + 1e-9 * (n + 1)  # absorb rounding in release times that are exact integers
        best, best_deadline = -1, math.inf
        for d in datasets:
            if release[d] <= t and deadline[d] < best_deadline:
                best, best_deadline = d, deadline[d]
        if best < 0:  # cannot happen in exact arithmetic; keep going on rounding noise
            best = min(datasets, key=deadline.__getitem__)
        view[n] = best
        c = count[best] = count[best] + 1
        release[best] = (c + sigma) * inv[best]
        deadline[best] = _deadline(c, sigma, inv[best])
    return out


# --------------------------------------------------------------------------- --data-path


def document_sizes(ds: MMapIndexedDataset) -> np.ndarray:
    """Tokens per document (int64). Equals ``ds.sizes`` when each document is one sequence."""
    sizes, doc_idx = ds.sizes, ds.doc_idx
    if len(doc_idx) == len(sizes) + 1 and np.array_equal(doc_idx, np.arange(len(doc_idx))):
        return sizes.astype(np.int64)
    cum = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
    return cum[doc_idx[1:]] - cum[doc_idx[:-1]]


@dataclass
class DataPath:
    """A parsed ``--data-path``: prefixes and normalized weights (None for one prefix)."""

    prefixes: list[str]
    weights: list[float] | None

    @property
    def is_blend(self) -> bool:
        return len(self.prefixes) > 1


def parse_data_path(data_path: Sequence[str] | str) -> DataPath:
    """Megatron's ``--data-path``: ``P``, ``W1 P1 W2 P2 ...`` or ``P1 P2 ...``.

    Parsed by the config's rules; weights are normalized here. Without weights several prefixes
    are mixed in proportion to their token counts (as if concatenated); the weights are filled
    in by :func:`blend_weights`.
    """
    items = [data_path] if isinstance(data_path, str) else [str(x) for x in data_path]
    prefixes, weights = config_data.parse_data_path(items)
    if weights is None:
        return DataPath(prefixes, None)
    return DataPath(prefixes, [float(w) for w in normalize_weights(weights)])


def blend_weights(path: DataPath, datasets: Sequence[MMapIndexedDataset]) -> list[float]:
    """The blend's weights: as given, or proportional to each dataset's tokens."""
    if path.weights is not None:
        return path.weights
    tokens = [ds.num_tokens for ds in datasets]
    for ds, n in zip(datasets, tokens):
        if n == 0:
            raise DataError("dataset has no tokens", where=str(ds.prefix))
    return [float(w) for w in normalize_weights(tokens)]


# --------------------------------------------------------------------------- cache


def fingerprint(sizes: np.ndarray, doc_idx: np.ndarray) -> str:
    """A cheap identity for an indexed dataset: counts, totals and a strided sample of sizes.

    Hashing every size of a billion-sequence dataset on every rank at start-up would cost
    seconds; the sample (with the totals) tells apart any two datasets one will meet in practice.
    """
    h = hashlib.sha256()
    h.update(np.array([len(sizes), len(doc_idx), int(sizes.sum(dtype=np.int64))]).tobytes())
    for a in (sizes, doc_idx):
        step = max(1, len(a) // 65536)
        h.update(np.ascontiguousarray(a[::step]).tobytes())
        h.update(np.ascontiguousarray(a[-16:]).tobytes())
    return h.hexdigest()[:16]


def description_hash(description: dict) -> str:
    text = json.dumps(description, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cache_files(cache_dir: Path, stem: str, keys: Sequence[str]) -> dict[str, Path]:
    return {key: cache_dir / f"{stem}_{key}.npy" for key in keys}


def load_or_build(
    cache_dir: str | os.PathLike,
    stem: str,
    description: dict,
    keys: Sequence[str],
    build: Callable[[], dict[str, np.ndarray]],
    *,
    is_builder: bool = True,
    barrier: Callable[[], None] | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, Path], bool]:
    """Load cached index arrays, building them first if this process is the builder.

    The files are ``<cache_dir>/<stem>_<hash>_<key>.npy`` plus ``..._desc.json``; the hash
    covers ``description``, so any change to what determines the arrays gives new files. The
    builder (rank 0) writes each file atomically, the description last as the mark of a
    complete set, then calls ``barrier``; every other rank calls ``barrier`` first and then
    loads. Every rank must call this the same number of times, in the same order.

    Returns the arrays (read-only memory maps), their paths, and whether this process loaded
    them rather than building them.
    """
    cache_dir = Path(cache_dir)
    stem = f"{stem}_{description_hash(description)}"
    paths = cache_files(cache_dir, stem, keys)
    desc_path = cache_dir / f"{stem}_desc.json"
    cached = desc_path.is_file() and all(p.is_file() for p in paths.values())
    if is_builder:
        if not cached:
            _build_and_save(cache_dir, desc_path, description, paths, build)
        if barrier is not None:
            barrier()
    else:
        if barrier is not None:
            barrier()
        cached = desc_path.is_file() and all(p.is_file() for p in paths.values())
        if not cached:
            raise DataError(
                "index cache not found after the building rank finished",
                where=str(desc_path),
                fix="the cache directory must be shared by all ranks (or build one per node); "
                "pass a shared --data-cache-path",
            )
    arrays = {}
    for key, p in paths.items():
        try:
            arrays[key] = np.load(p, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as e:
            raise DataError(
                f"unreadable index cache file ({e})",
                where=str(p),
                fix=f"delete {cache_dir / stem}_* and run again to rebuild it",
            ) from e
    return arrays, paths, cached


def _build_and_save(
    cache_dir: Path,
    desc_path: Path,
    description: dict,
    paths: dict[str, Path],
    build: Callable[[], dict[str, np.ndarray]],
) -> None:
    start = time.perf_counter()
    arrays = build()
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        for key, p in paths.items():
            with atomic_open(p, "wb") as f:
                np.save(f, arrays[key], allow_pickle=False)
        atomic_write_text(desc_path, json.dumps(description, indent=1, sort_keys=True) + "\n")
    except OSError as e:
        if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        raise DataError(
            "cannot write the index cache",
            where=str(cache_dir),
            fix="pass a writable cache directory (--data-cache-path)",
        ) from e
    log.info(
        "built %s in %.2f s", desc_path.name.removesuffix("_desc.json"), time.perf_counter() - start
    )
