"""DeepSpeed's outputs of zero_to_fp32: a whole fp32 state dict in memory (or lazily, one
tensor at a time), and an output directory of ``pytorch_model.bin`` / ``model.safetensors``
split into shards of at most ``max_shard_size`` with Hugging Face's index file.

The reading is :mod:`zerotron.checkpoint.zero_to_fp32`'s (memory-mapped ZeRO files, one
parameter or one shard assembled at a time); this module decides what goes in which file and
writes it. The layout is the one ``transformers`` loads (``from_pretrained(output_dir)``)::

    pytorch_model.bin                           one file when everything fits in one shard
    pytorch_model-00001-of-00003.bin ...        else shards, filled in state-dict order,
    pytorch_model.bin.index.json                {"metadata": {"total_size": bytes},
                                                 "weight_map": {name: shard file}}

(``model.safetensors``, ``model-00001-of-00003.safetensors`` and
``model.safetensors.index.json`` with ``safe_serialization``.) A shard closes before a tensor
would take it past ``max_shard_size``; a tensor larger than that gets a shard of its own.
Tied weights: a ``.bin`` holds every name (``torch.save`` keeps one storage), a safetensors
file stores the tensor once under its first name (safetensors refuses shared storage) and lists
the other names in its metadata, as ``zerotron zero-to-fp32`` does.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from zerotron.checkpoint import layout
from zerotron.checkpoint.zero_to_fp32 import (
    MpRank,
    _mp_ranks,
    _state_dict,
    _write_safetensors,
    find_checkpoint,
)
from zerotron.errors import CheckpointError, ConfigError
from zerotron.fileio import atomic_open, atomic_write_text

SIZE_UNITS = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}
"""Units of ``max_shard_size`` (decimal, as Hugging Face's ``parse_size_to_int``)."""


def parse_size(size: int | str) -> int:
    """Bytes of ``"5GB"``, ``"500MB"``, ``"1.5TB"``... (or an int, returned as it is)."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]B)\s*", str(size).upper())
    if m is None:
        raise ConfigError(
            f"max_shard_size {size!r} is not a size",
            where="max_shard_size",
            fix='write digits followed by a unit, e.g. "5GB" or "500MB" (units KB, MB, GB, TB)',
        )
    return int(float(m.group(1)) * SIZE_UNITS[m.group(2)])


@dataclass
class Split:
    """Which names go in which file: ``files`` in order, each with its names."""

    files: dict[str, list[str]]
    total_size: int

    @property
    def is_sharded(self) -> bool:
        return len(self.files) > 1

    def weight_map(self) -> dict[str, str]:
        return {name: file for file, names in self.files.items() for name in names}


def split_into_shards(
    sizes: dict[str, int], max_shard_size: int | str | None, weights_name: str
) -> Split:
    """Shards of the tensors ``sizes`` (name -> bytes, in state-dict order), filled in order.

    ``weights_name`` is the one-file name (``pytorch_model.bin``); shards are named
    ``pytorch_model-00001-of-0000N.bin``. ``None``: one file, whatever its size.
    """
    total = sum(sizes.values())
    if max_shard_size is None:
        return Split({weights_name: list(sizes)}, total)
    limit = parse_size(max_shard_size)
    shards: list[list[str]] = []
    current: list[str] = []
    used = 0
    for name, nbytes in sizes.items():
        if nbytes > limit:  # too big for any shard: one of its own
            shards.append([name])
            continue
        if current and used + nbytes > limit:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += nbytes
    if current or not shards:
        shards.append(current)
    if len(shards) == 1:
        return Split({weights_name: shards[0]}, total)
    stem, ext = weights_name.rsplit(".", 1)
    n = len(shards)
    return Split({f"{stem}-{k + 1:05d}-of-{n:05d}.{ext}": s for k, s in enumerate(shards)}, total)


def the_mp_rank(checkpoint_dir: str | os.PathLike, tag: str | None) -> tuple[Path, MpRank]:
    """The tag directory and its one model-parallel rank (DeepSpeed's zero_to_fp32 merges
    data-parallel partitions only)."""
    root, tag = find_checkpoint(checkpoint_dir, tag)
    tag_dir = layout.tag_dir(root, tag)
    ranks = _mp_ranks(tag_dir)
    if len(ranks) != 1:
        raise CheckpointError(
            f"the checkpoint has {len(ranks)} model-parallel ranks (tensor or pipeline "
            "parallel); DeepSpeed's zero_to_fp32 output holds one model",
            where=str(tag_dir),
            fix="run `zerotron zero-to-fp32 CKPT OUT` (one file per model-parallel rank), or "
            "`zerotron convert` to merge the tensor-parallel shards",
        )
    return tag_dir, ranks[0]


def kept_names(rank: MpRank, exclude_frozen_parameters: bool) -> list[str]:
    """The stored names (aliases of tied weights excluded) of the output, in state-dict order.

    Frozen parameters are the model-file tensors that are neither trained (in the ZeRO files)
    nor buffers; a checkpoint that does not list its buffers keeps them all.
    """
    trained = {p.name for p in rank.plans}
    if not exclude_frozen_parameters or rank.buffers is None:
        return list(rank.order)
    return [n for n in rank.order if n in trained or n in rank.buffers]


class LazyTensor:
    """One parameter of a ZeRO checkpoint, assembled from the files by :meth:`contiguous`
    (DeepSpeed's ``lazy_mode``): ``shape`` and ``dtype`` are known without reading."""

    def __init__(self, tag_dir: Path, rank: MpRank, name: str, shape: torch.Size):
        self.tag_dir, self.rank, self.name = tag_dir, rank, name
        self.shape = torch.Size(shape)
        self.dtype = torch.float32

    def contiguous(self) -> torch.Tensor:
        """The fp32 tensor (read now)."""
        return _state_dict(self.tag_dir, self.rank, {self.name})[self.name]

    def __repr__(self) -> str:
        return f"LazyTensor({self.name!r}, shape={tuple(self.shape)})"


def fp32_state_dict(
    checkpoint_dir: str | os.PathLike,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
    lazy_mode: bool = False,
) -> dict[str, torch.Tensor | LazyTensor]:
    """The consolidated fp32 state dict (DeepSpeed's ``get_fp32_state_dict_from_zero_
    checkpoint``); tied weights appear under each name as the same tensor. ``lazy_mode``:
    trained parameters are :class:`LazyTensor` s, read one at a time by ``.contiguous()``.
    A checkpoint DeepSpeed saved is read too (whole tensors, also in ``lazy_mode``)."""
    from zerotron.checkpoint.deepspeed_format import deepspeed_fp32_state_dict

    saved_by_deepspeed = deepspeed_fp32_state_dict(checkpoint_dir, tag, exclude_frozen_parameters)
    if saved_by_deepspeed is not None:
        return dict(saved_by_deepspeed)
    tag_dir, rank = the_mp_rank(checkpoint_dir, tag)
    keep = set(kept_names(rank, exclude_frozen_parameters))
    if not lazy_mode:
        return _state_dict(tag_dir, rank, keep)
    shapes = {p.name: p.shape for p in rank.plans}
    own: dict[str, torch.Tensor | LazyTensor] = {
        name: LazyTensor(tag_dir, rank, name, shapes[name])
        if name in shapes
        else rank.extras[name].clone()
        for name in rank.order
        if name in keep
    }
    return {k: own[rank.shared.get(k, k)] for k in rank.keys if rank.shared.get(k, k) in keep}


def write_fp32_model(
    checkpoint_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    max_shard_size: int | str | None = "5GB",
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> list[Path]:
    """Write the fp32 model into ``output_dir`` in DeepSpeed's layout (module docstring);
    return the files written. One shard is in memory at a time (``.bin``), or none
    (safetensors, written piece by piece)."""
    tag_dir, rank = the_mp_rank(checkpoint_dir, tag)
    names = kept_names(rank, exclude_frozen_parameters)
    shapes = {p.name: p.shape for p in rank.plans}
    sizes = {}
    for name in names:
        t = rank.extras.get(name)
        sizes[name] = (
            t.numel() * t.element_size() if t is not None else 4 * torch.Size(shapes[name]).numel()
        )
    weights_name = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    split = split_into_shards(sizes, max_shard_size, weights_name)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for file, members in split.files.items():
        if safe_serialization:
            written.append(
                _write_safetensors(
                    tag_dir, rank, out / file, {"source": str(tag_dir)}, set(members)
                )
            )
        else:
            with atomic_open(out / file, "wb") as f:
                torch.save(_state_dict(tag_dir, rank, set(members)), f)
            written.append(out / file)
    if split.is_sharded:
        weight_map = split.weight_map()
        if not safe_serialization:  # a .bin holds the tied names too
            weight_map.update({a: weight_map[n] for a, n in rank.shared.items() if n in weight_map})
        index = {"metadata": {"total_size": split.total_size}, "weight_map": weight_map}
        index_path = out / f"{weights_name}.index.json"
        atomic_write_text(index_path, json.dumps(index, indent=2, sort_keys=True) + "\n")
        written.append(index_path)
    return written
