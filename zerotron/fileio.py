"""Crash-safe file writes: write under a temporary name, fsync, rename.

A reader never sees a half-written file: either the old content or the new. Used by
preprocessing (.bin/.idx), index caches and checkpoints.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from zerotron.errors import ConfigError, DiskFullError


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


WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)
"""Write failures that are the disk's fault, not a bug: reported as :class:`DiskFullError`."""

# torch.save reports a failed write as a RuntimeError from its zip writer, without the errno.
_TORCH_WRITE_FAILURES = ("inline_container", "PytorchStreamWriter", "file write failed")


def human_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``: sizes in messages a user reads."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def free_bytes(path: str | os.PathLike) -> int | None:
    """Free space (for this user) on the filesystem holding ``path`` or its nearest parent."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def disk_write_error(path: str | os.PathLike, e: BaseException) -> DiskFullError | None:
    """The :class:`DiskFullError` for a failed write of ``path``, or None if ``e`` is no such.

    ENOSPC/EDQUOT/EROFS (an OSError, or safetensors' error naming ``os error 28``), and
    torch.save's zip-writer RuntimeError (which hides the errno: it is
    taken for a full disk when the filesystem has less than 1 MiB left, or ENOSPC is its cause).
    """
    code = getattr(e, "errno", None)
    rust = re.search(r"\(os error (\d+)\)", str(e))  # safetensors' SafetensorError
    if code is None and rust:
        code = int(rust.group(1))
    if isinstance(e, RuntimeError) and any(m in str(e) for m in _TORCH_WRITE_FAILURES):
        cause = e.__cause__ or e.__context__
        free = free_bytes(path)
        if getattr(cause, "errno", None) in WRITE_ERRNOS:
            code = cause.errno  # type: ignore[union-attr]
        elif free is not None and free < 1024 * 1024:
            code = errno.ENOSPC
    if code not in WRITE_ERRNOS:
        return None
    free = free_bytes(path)
    left = f" ({human_bytes(free)} free there)" if free is not None else ""
    if code == errno.EROFS:
        what, fix = "the file system is read-only", "write elsewhere"
    elif code == errno.EDQUOT:
        what, fix = "disk quota exceeded while writing", "free space or write elsewhere"
    else:
        what, fix = f"no space left on device while writing{left}", "free space or write elsewhere"
    return DiskFullError(what, where=str(path), fix=f"{fix}; nothing partial was kept")


@contextlib.contextmanager
def disk_full_is_clear(path: str | os.PathLike) -> Iterator[None]:
    """Turn a write failure that is the disk's fault (see :func:`disk_write_error`) into a
    :class:`DiskFullError` naming ``path``. The caller removes what it wrote."""
    try:
        yield
    except Exception as e:  # OSError, torch's RuntimeError, safetensors' SafetensorError
        err = disk_write_error(path, e)
        if err is None:
            raise
        raise err from e


def check_free_space(path: str | os.PathLike, needed: int, what: str = "the write") -> None:
    """Refuse a write of ``needed`` bytes under ``path`` before starting it, if it cannot fit.

    Saying so up front beats filling the disk (which may break other jobs) and then failing.
    """
    free = free_bytes(path)
    if free is None or needed <= free:
        return
    raise DiskFullError(
        f"not enough space for {what}: it needs {human_bytes(needed)}, {human_bytes(free)} is free",
        where=str(path),
        fix="free space or write elsewhere; nothing was written",
    )


def check_writable_dir(path: str | os.PathLike, flag: str) -> None:
    """Check at start that ``path`` is (or can be made) a directory this process can write into.

    A bad output path is otherwise found only at the first write, after hours of work. Creates
    the directory (as the later write would) and a probe file it removes.
    """
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ConfigError(
            f"{p} exists and is not a directory", where=flag, fix="pass a directory path"
        )
    try:
        p.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".zerotron-write-test-", dir=p)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(
            f"cannot write into {p}: {e.strerror or e}",
            where=flag,
            fix="pass a directory you can write to (check its permissions and the disk)",
        ) from None


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
