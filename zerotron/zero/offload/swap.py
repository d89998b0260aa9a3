"""NVMe swapping: named tensors as raw files under ``<nvme_path>/zerotron_swap/<name>/``.

One file per key, written to a temporary file and renamed over the old one only when every
byte is in, so a full disk (:class:`~zerotron.errors.DiskFullError`) never corrupts what was
there. Reads check the exact size. No pickle anywhere: dtypes and shapes stay in memory. Swap
files are scratch (not fsynced, deleted at close or exit); checkpoints are the durable copy.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import shutil
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from zerotron.errors import CheckpointError, ConfigError, DiskFullError
from zerotron.fileio import temp_path

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def default_rank_name() -> str:
    """This process's name for its swap directories (one per process): ``rank<global rank>``."""
    dist = torch.distributed
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return f"rank{rank}"


class TensorSpec(NamedTuple):
    """dtype and shape of one stored tensor (what a raw file cannot say itself)."""

    dtype: torch.dtype
    shape: torch.Size

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _bytes_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (works for bf16, which numpy lacks)."""
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())


def _remove_dir(path: Path, lock_fd: int, owner: int) -> None:
    if os.getpid() != owner:  # a forked child exiting must not delete its parent's files
        return
    shutil.rmtree(path, ignore_errors=True)
    with contextlib.suppress(OSError):
        os.unlink(f"{path}.lock")
    with contextlib.suppress(OSError):
        path.parent.rmdir()  # zerotron_swap/, if no other process uses it
    with contextlib.suppress(OSError):
        os.close(lock_fd)  # releases the flock


def _open_lock(path: Path) -> int:
    """Create ``zerotron_swap/`` and open ``<path>.lock`` in it.

    Another rank that finishes removes ``zerotron_swap/`` once it is empty (``_remove_dir``); it
    can do so between our ``mkdir`` and ``open``, so retry. Once our lock file is in it, the
    directory is not empty and stays.
    """
    for attempt in range(100):
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            return os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except FileNotFoundError:
            if attempt == 99:
                raise
    raise AssertionError("unreachable")


class NVMeSwapper:
    """Named tensors (or lists of tensors) as raw files under ``<root>/zerotron_swap/<name>/``.

    One file per key (``<key>.bin``), holding the tensors' bytes back to back; dtypes and
    shapes stay in this object, so a file is never interpreted without them and nothing is
    unpickled. The directory belongs to this object: a stale one from an earlier run is
    emptied, a second live process asking for the same one gets a :class:`ConfigError`, and
    :meth:`cleanup` (or garbage collection, or interpreter exit) removes it.

    Args:
        root: the ``nvme_path`` directory.
        name: this process's subdirectory, e.g. ``"rank3.optimizer"``.
        where: the config key to name in a disk-full error.
    """

    def __init__(self, root: str | os.PathLike, name: str, *, where: str = "nvme_path"):
        if not _NAME.fullmatch(name):
            raise ValueError(f"swap name {name!r}: use letters, digits, '.', '_' or '-'")
        self.root = Path(root)
        self.where = where
        self.dir = self.root / "zerotron_swap" / name
        lock_fd = _open_lock(self.dir)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock_fd)
            raise ConfigError(
                f"swap directory {self.dir} is in use by another process",
                where=where,
                fix="give every process its own rank name, or each job its own nvme_path",
            ) from None
        shutil.rmtree(self.dir, ignore_errors=True)  # ours, left by a process that died
        self.dir.mkdir()
        self._specs: dict[str, tuple[list[TensorSpec], bool]] = {}  # key -> (specs, is_list)
        self._paths: dict[str, Path] = {}
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _remove_dir, self.dir, lock_fd, os.getpid())

    def path(self, key: str) -> Path:
        """The file of ``key``: the key itself where it is a safe file name (parameter names
        are), else a sanitized form made unique."""
        with self._lock:
            path = self._paths.get(key)
            if path is None:
                stem = _UNSAFE.sub("_", key)[:120]
                stem = stem if _NAME.fullmatch(stem) else f"_{stem}"
                path = self.dir / f"{stem}.bin"
                taken = set(self._paths.values())
                n = 1
                while path in taken:
                    path, n = self.dir / f"{stem}~{n}.bin", n + 1
                self._paths[key] = path
            return path

    def __contains__(self, key: str) -> bool:
        return key in self._specs

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._specs)

    def specs(self, key: str) -> list[TensorSpec]:
        """dtype and shape of each tensor stored under ``key``."""
        return list(self._specs[key][0])

    def nbytes(self, key: str) -> int:
        return sum(s.nbytes for s in self._specs[key][0])

    def bytes_on_disk(self) -> int:
        """Bytes of all stored tensors (the files' sizes)."""
        with self._lock:
            return sum(s.nbytes for specs, _ in self._specs.values() for s in specs)

    def swap_out(self, key: str, tensors: torch.Tensor | Sequence[torch.Tensor]) -> None:
        """Write ``tensors`` as the new content of ``key``, replacing the old one atomically.

        Raises :class:`DiskFullError` (naming the file, the bytes and the free space) if the
        disk fills; the previous content of ``key`` is then still intact and readable.
        """
        is_list = not isinstance(tensors, torch.Tensor)
        ts = [t.detach() for t in (tensors if is_list else [tensors])]
        ts = [t.cpu().contiguous() if t.device.type != "cpu" else t.contiguous() for t in ts]
        specs = [TensorSpec(t.dtype, t.shape) for t in ts]
        path = self.path(key)
        total = sum(s.nbytes for s in specs)
        tmp = temp_path(path)
        written = 0
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                for t in ts:
                    view = _bytes_view(t)
                    off = 0
                    while off < len(view):
                        n = os.write(fd, view[off:])
                        if n <= 0:
                            raise OSError(errno.ENOSPC, "write made no progress")
                        off += n
                        written += n
                size = os.fstat(fd).st_size
            finally:
                os.close(fd)
            if size != total:  # a write that claimed more than it stored
                written = size
                raise OSError(errno.ENOSPC, f"file holds {size} bytes after writing")
            os.replace(tmp, path)
        except OSError as e:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise self._disk_full(path, written, total) from e
            raise
        with self._lock:
            self._specs[key] = (specs, is_list)

    def _disk_full(self, path: Path, written: int, total: int) -> DiskFullError:
        try:
            free = f"{shutil.disk_usage(self.dir).free:,} bytes free"
        except OSError:
            free = "free space unknown"
        return DiskFullError(
            f"disk full writing swap file {path}: {written:,} of {total:,} bytes written, "
            f"{free} under {self.root}; the previous content of the file is intact",
            where=self.where,
            fix=f"free space under {self.root} or point {self.where} at a larger disk",
        )

    def swap_in(
        self, key: str, out: torch.Tensor | Sequence[torch.Tensor] | None = None
    ) -> torch.Tensor | list[torch.Tensor]:
        """Read ``key`` back: into ``out`` (contiguous CPU tensors of the stored dtypes and
        shapes, e.g. pool buffers) or into new tensors. Returns a list if a list was stored.

        A file whose size differs from what was written raises :class:`CheckpointError`.
        """
        specs, is_list = self._specs[key]
        if out is None:
            outs = [torch.empty(s.shape, dtype=s.dtype) for s in specs]
        else:
            outs = list(out) if not isinstance(out, torch.Tensor) else [out]
            for o, s in zip(outs, specs, strict=True):
                if o.dtype != s.dtype or o.shape != s.shape:
                    raise ValueError(
                        f"swap_in({key!r}): buffer {o.dtype} {tuple(o.shape)} for a stored "
                        f"{s.dtype} {tuple(s.shape)}"
                    )
                if o.device.type != "cpu" or not o.is_contiguous():
                    raise ValueError(f"swap_in({key!r}): buffers must be contiguous CPU tensors")
        path = self.path(key)
        total = sum(s.nbytes for s in specs)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise CheckpointError(
                f"swap file {path} is missing",
                where=self.where,
                fix="something removed the swap directory while training ran; "
                "restart from the last checkpoint, with a private nvme_path",
            ) from None
        try:
            size = os.fstat(fd).st_size
            if size != total:
                raise CheckpointError(
                    f"swap file {path} holds {size:,} bytes, expected {total:,}",
                    where=self.where,
                    fix="something truncated or rewrote the swap file; restart from the "
                    "last checkpoint, with a private nvme_path",
                )
            for o in outs:
                view = _bytes_view(o)
                off = 0
                while off < len(view):
                    n = os.readv(fd, [view[off:]])
                    if n <= 0:
                        raise CheckpointError(
                            f"swap file {path} ended early", where=self.where, fix=None
                        )
                    off += n
        finally:
            os.close(fd)
        return outs if is_list else outs[0]

    def release(self, key: str) -> None:
        """Forget ``key`` and delete its file."""
        with self._lock:
            self._specs.pop(key, None)
            path = self._paths.pop(key, None)
        if path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def cleanup(self) -> None:
        """Delete the directory and everything in it."""
        with self._lock:
            self._specs.clear()
            self._paths.clear()
        self._finalizer()
