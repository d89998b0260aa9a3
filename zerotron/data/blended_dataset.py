"""A weighted mixture of datasets (Megatron's ``--data-path 0.3 A 0.7 B``).

Sample ``i`` of the blend is sample ``dataset_sample_index[i]`` of dataset
``dataset_index[i]``; the two arrays follow the weights as closely as any sequence can
(:func:`zerotron.data.index_builder.build_blending_indices`: after every prefix of n samples each
dataset has served within one sample of ``weight * n``). Each component is built for exactly the
number of samples the blend takes from it, and the index is cached like the GPT indices.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from zerotron.data import index_builder as ib
from zerotron.errors import DataError

BLEND_KEYS = ("dataset_index", "dataset_sample_index")


class BlendedDataset(torch.utils.data.Dataset):
    """``size`` samples drawn from ``datasets`` in proportion to ``weights``.

    ``dataset_index`` / ``dataset_sample_index`` come from
    :func:`~zerotron.data.index_builder.build_blending_indices` (or its cache, whose file names
    go in ``index_files`` so that workers reopen them instead of receiving copies).
    """

    def __init__(
        self,
        datasets: Sequence[torch.utils.data.Dataset | None],
        weights: Sequence[float],
        size: int,
        *,
        dataset_index: np.ndarray,
        dataset_sample_index: np.ndarray,
        index_files: dict[str, Path] | None = None,
    ):
        self.datasets = list(datasets)
        self.weights = [float(w) for w in ib.normalize_weights(weights)]
        self.size = int(size)
        self._index_files = index_files
        self._set_arrays(dataset_index, dataset_sample_index)
        counts = self.counts()
        for d, (ds, n) in enumerate(zip(self.datasets, counts)):
            have = 0 if ds is None else len(ds)
            if have < n:
                raise DataError(f"blend component {d} has {have} samples, the blend needs {n}")

    def _set_arrays(self, dataset_index: np.ndarray, dataset_sample_index: np.ndarray) -> None:
        if dataset_index.shape != (self.size,) or dataset_sample_index.shape != (self.size,):
            raise DataError(
                f"blend index has {dataset_index.shape[0]} entries, expected {self.size}",
                fix="delete the blend index cache files and run again",
            )
        self.dataset_index = dataset_index
        self.dataset_sample_index = dataset_sample_index

    def counts(self) -> list[int]:
        """How many samples the blend takes from each dataset."""
        return np.bincount(self.dataset_index, minlength=len(self.weights)).tolist()

    @classmethod
    def build(
        cls,
        make_component: Callable[[int, int], torch.utils.data.Dataset],
        weights: Sequence[float],
        size: int,
        *,
        name: str,
        description: dict,
        cache_dir: str | os.PathLike,
        is_builder: bool = True,
        barrier: Callable[[], None] | None = None,
    ) -> BlendedDataset:
        """Build (or load) the blend index, then ``make_component(d, count)`` for each dataset.

        ``description`` names what the components are (prefixes, split, seed, ...) for the
        cache hash; the weights and ``size`` are added here.
        """
        weights = [float(w) for w in ib.normalize_weights(weights)]
        full = {"class": "BlendedDataset", "format": ib.INDEX_FORMAT, "name": name, **description}
        full.update(weights=weights, size=int(size))

        def build() -> dict[str, np.ndarray]:
            index, sample = ib.build_blending_indices(weights, size)
            return {"dataset_index": index, "dataset_sample_index": sample}

        arrays, files, _ = ib.load_or_build(
            cache_dir,
            f"blend_{name}",
            full,
            BLEND_KEYS,
            build,
            is_builder=is_builder,
            barrier=barrier,
        )
        counts = np.bincount(arrays["dataset_index"], minlength=len(weights))
        datasets = [make_component(d, int(n)) if n else None for d, n in enumerate(counts)]
        return cls(datasets, weights, size, index_files=files, **arrays)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int):
        if not 0 <= idx < self.size:
            raise IndexError(f"sample {idx} out of range for {self.size} samples")
        d = int(self.dataset_index[idx])
        return self.datasets[d][int(self.dataset_sample_index[idx])]

    # Pickle by file names: a DataLoader worker reopens the memory maps.
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        if self._index_files is not None:
            for key in BLEND_KEYS:
                del state[key]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self._index_files is not None:
            self._set_arrays(
                *(
                    np.load(self._index_files[k], mmap_mode="r", allow_pickle=False)
                    for k in BLEND_KEYS
                )
            )
