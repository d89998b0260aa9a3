"""Offline conversion of a checkpoint to another layout, optimizer state included, streamed.

``zerotron convert --load A --save B --target-...``: every rank of the target layout gets the
files its own save would write (:mod:`zerotron.checkpoint.target`), written tensor by tensor
(:mod:`zerotron.checkpoint.stream_save`) from the source read lazily
(:mod:`zerotron.checkpoint.canonical`), so no process group is needed and the memory held is
bounded by the largest tensor (a few copies of it: the full fp32 tensor being cut, the target
tensor it is cut into, and the source pages touched since the last release), not the model
(:func:`unmap_large_frees` keeps freed tensors from piling up in the heap).
The tag is assembled in ``<save>/.<tag>.tmp/`` and committed like every save: metadata.json,
the rename into place, then the trackers.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from zerotron.checkpoint import layout as names
from zerotron.checkpoint.canonical import CanonicalCheckpoint, Layout, open_checkpoint
from zerotron.checkpoint.in_memory import InMemoryCheckpoint
from zerotron.checkpoint.reshard import target_padded_vocab_size
from zerotron.checkpoint.stream_save import save_streaming
from zerotron.checkpoint.target import check_target, rank_files, target_metadata
from zerotron.errors import ConfigError
from zerotron.fileio import disk_full_is_clear
from zerotron.progress import Progress

try:  # ckpt-trust's commit path: metadata.json with per-file checksums
    from zerotron.checkpoint import begin_tag, commit_tag, record_checksum  # type: ignore[attr-defined]
except ImportError:  # not merged yet: save_load's own commit (no checksums)
    begin_tag = commit_tag = record_checksum = None


def start_tag(save_dir: Path, tag: str) -> Path:
    """The empty temporary directory ``<save>/.<tag>.tmp/`` to write a tag's files into."""
    if begin_tag is not None:
        return begin_tag(save_dir, tag)
    from zerotron.checkpoint.save_load import _clean_stale

    save_dir.mkdir(parents=True, exist_ok=True)
    _clean_stale(save_dir)
    tmp = names.temp_tag_dir(save_dir, tag)
    tmp.mkdir()
    return tmp


def finish_tag(save_dir: Path, tag: str, tmp: Path, metadata: dict[str, Any]) -> Path:
    """Commit ``tmp`` as ``<save>/<tag>/``: metadata.json, the rename, then the trackers."""
    if commit_tag is not None:
        return commit_tag(save_dir, tag, metadata)
    from zerotron.checkpoint.save_load import _finish

    final = names.tag_dir(save_dir, tag)
    _finish(save_dir, tag, tmp, final, metadata, names.iteration_from_tag(tag), True)
    return final


MMAP_THRESHOLD = 1 << 20
"""Allocations from this size on get their own mapping (glibc's ``M_MMAP_THRESHOLD``)."""


def unmap_large_frees() -> bool:
    """Give every allocation of :data:`MMAP_THRESHOLD` bytes or more its own mapping, returned
    to the OS when freed (glibc only; returns whether it is in effect).

    A conversion allocates and frees thousands of tensors of a few MB (full parameters, flat
    sub-groups) between small Python objects. In glibc's heap (where its dynamic threshold puts
    everything under 32 MB) the holes they leave are not reused in time and resident memory
    grew by about one written tensor per tensor until each file was closed (3.6 GB for the
    345M bench, bench/README.md); mapped, each one is gone when freed.
    """
    if os.environ.get("ZEROTRON_KEEP_HEAP") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        if not hasattr(libc, "gnu_get_libc_version"):
            return False
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))


M_MMAP_THRESHOLD = -3  # glibc's malloc.h


def convert_checkpoint(
    load_dir: str | os.PathLike,
    save_dir: str | os.PathLike,
    target: Layout,
    *,
    tag: str | None = None,
    make_vocab_size_divisible_by: int = 128,
    progress: Progress | None = None,
    on_tensor: Callable[[torch.Tensor], None] | None = None,
) -> Path:
    """Write ``load_dir``'s checkpoint (``tag``, default the latest) into ``save_dir`` under the
    same tag, laid out as ``target``; return the tag directory.

    Weights, fp32 masters, optimizer state (moments, steps), loss scaler, LR scheduler, step
    counters and consumed samples are carried; RNG streams for the (tp, pp) ranks the source
    has. ``target.padded_vocab_size`` None: the vocabulary padded to
    ``make_vocab_size_divisible_by × tp``. ``progress`` counts the read, each written file and
    the commit; ``on_tensor(t)`` sees every written tensor while it is alive (memory accounting).
    """
    unmap_large_frees()
    if Path(load_dir).resolve() == Path(save_dir).resolve():
        raise ConfigError(
            "--save must be another directory than --load",
            where="zerotron convert",
            fix="write the converted checkpoint next to the source, e.g. --save CKPT-tp1",
        )
    with open_checkpoint(load_dir, tag) as ckpt:
        if target.padded_vocab_size is None:
            rows = target_padded_vocab_size(
                ckpt.meta, target.tensor_parallel, make_vocab_size_divisible_by
            )
            target = replace(target, padded_vocab_size=rows)
        return write_layout(ckpt, save_dir, target, progress=progress, on_tensor=on_tensor)


def write_layout(
    ckpt: CanonicalCheckpoint | InMemoryCheckpoint,
    save_dir: str | os.PathLike,
    target: Layout,
    *,
    progress: Progress | None = None,
    on_tensor: Callable[[torch.Tensor], None] | None = None,
) -> Path:
    """Write ``ckpt`` into ``save_dir`` under its tag, laid out as ``target``, and commit it;
    return the tag directory. ``target.padded_vocab_size`` None: the vocabulary padded as
    :meth:`Layout.with_defaults` pads it. ``progress`` and ``on_tensor`` as for
    :func:`convert_checkpoint`."""
    target = check_target(ckpt, target)
    if progress is not None:
        progress.update(1, info=f"read {ckpt.tag} ({ckpt.layout.describe()})")
    save = Path(save_dir)
    tmp = start_tag(save, ckpt.tag)
    try:
        for t, p in target.mp_ranks():
            for d in range(target.data_parallel):
                for rel, tree in rank_files(ckpt, target, t, p, d).items():
                    path = tmp / rel
                    path.parent.mkdir(parents=True, exist_ok=True)
                    with disk_full_is_clear(path), open(path, "wb") as f:
                        save_streaming(tree, f, on_tensor=on_tensor)
                        f.flush()
                        os.fsync(f.fileno())
                    if record_checksum is not None:
                        record_checksum(tmp, rel)
                    if progress is not None:
                        progress.update(1, info=f"wrote {rel}")
        path = finish_tag(save, ckpt.tag, tmp, target_metadata(ckpt, target))
        if progress is not None:
            progress.update(1, info=f"wrote {path}")
        return path
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def progress_steps(target: Layout) -> int:
    """The progress bar's total: the read, one step per file of ``target``, the commit."""
    mp = target.tensor_parallel * target.pipeline_parallel
    return 2 + mp * (1 + (target.data_parallel if target.zero_stage else 0))
