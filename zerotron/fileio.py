"""Crash-safe file writes: write under a temporary name, fsync, rename.

A reader never sees a half-written file: either the old content or the new. Used by
preprocessing (.bin/.idx), index caches and checkpoints.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from zerotron.errors import DiskFullError


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_path(final: str | os.PathLike) -> Path:
    """A unique temporary name next to ``final`` (same filesystem, so rename is atomic)."""
    final = Path(final)
    return final.with_name(f".{final.name}.tmp-{os.getpid()}-{os.urandom(3).hex()}")


def commit(tmp: str | os.PathLike, final: str | os.PathLike) -> None:
    """fsync ``tmp`` (a file) and atomically rename it to ``final``."""
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, final)
    fsync_dir(Path(final).parent)


@contextlib.contextmanager
def disk_full_is_clear(path: str | os.PathLike) -> Iterator[None]:
    """Turn ENOSPC into a :class:`DiskFullError` naming ``path``."""
    try:
        yield
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFullError(
                "no space left on device while writing",
                where=str(path),
                fix="free space or write elsewhere; nothing partial was kept",
            ) from e
        raise


@contextlib.contextmanager
def atomic_open(final: str | os.PathLike, mode: str = "wb") -> Iterator:
    """Open a temporary file that becomes ``final`` only if the block completes."""
    tmp = temp_path(final)
    try:
        with disk_full_is_clear(final):
            with open(tmp, mode) as f:
                yield f
                f.flush()
            commit(tmp, final)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def atomic_write_bytes(final: str | os.PathLike, data: bytes) -> None:
    with atomic_open(final, "wb") as f:
        f.write(data)


def atomic_write_text(final: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(final, text.encode())


def atomic_dir(final: str | os.PathLike) -> tempfile.TemporaryDirectory:
    """A temporary directory beside ``final``; rename it into place with :func:`commit_dir`."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    return tempfile.TemporaryDirectory(
        prefix=f".{final.name}.tmp-", dir=final.parent, ignore_cleanup_errors=True
    )


def commit_dir(tmp_dir: str | os.PathLike, final: str | os.PathLike) -> None:
    """fsync every file under ``tmp_dir`` and rename it to ``final`` (replacing an old one)."""
    tmp_dir, final = Path(tmp_dir), Path(final)
    for root, _dirs, files in os.walk(tmp_dir):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(root)
    if final.exists():
        # Move the old one aside first so `final` is never a mix of old and new files.
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, old)
        os.replace(tmp_dir, final)
        fsync_dir(final.parent)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp_dir, final)
        fsync_dir(final.parent)


def recover_dir(final: str | os.PathLike) -> bool:
    """Repair what a process killed inside :func:`commit_dir` left behind.

    Replacing a directory takes two renames (old aside, new in). Killed between them, ``final``
    is missing and the old version sits under its ``.<name>.old-<pid>`` name: put it back.
    Killed after them, the old version is garbage: delete it. Returns True if it restored one.
    Safe to call from several processes at once.
    """
    final = Path(final)
    prefix = f".{final.name}.old-"
    try:
        olds = sorted(final.parent / n for n in os.listdir(final.parent) if n.startswith(prefix))
    except FileNotFoundError:
        return False
    restored = False
    if not final.exists() and olds:
        with contextlib.suppress(FileNotFoundError):  # another process restored it first
            os.replace(olds.pop(), final)
            fsync_dir(final.parent)
            restored = True
    for old in olds:
        if old.exists() and final.exists():
            shutil.rmtree(old, ignore_errors=True)
    return restored
