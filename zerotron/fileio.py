"""Crash-safe file writes: write under a temporary name, fsync, rename; and append-only logs.

A reader never sees a half-written file: either the old content or the new. Used by
preprocessing (.bin/.idx), index caches and checkpoints.

Append-only JSON-lines logs (:class:`MetricsFile`, the run's metrics file of ``zerotron
report``) are the other crash-safe shape: each record is one line, written and flushed at once,
so a crash loses at most the line being written, and readers skip a truncated last line. They
live here, at the bottom of the layers, so the Engine and the training loop write through one
class; :mod:`zerotron.training.metrics` is their documented entry.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from zerotron.errors import ConfigError, DataError, DiskFullError


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


def metrics_path(directory: str | os.PathLike, rank: int) -> Path:
    """Rank ``rank``'s metrics file in a run directory: ``<directory>/metrics/rank<R>.jsonl``."""
    return Path(directory) / "metrics" / f"rank{int(rank)}.jsonl"


def _jsonable(value: object) -> object:
    """JSON for what training code hands over: tensors and numpy scalars, paths, sets."""
    if hasattr(value, "item") and callable(value.item):  # 0-d tensor, numpy scalar
        return value.item()
    if hasattr(value, "tolist") and callable(value.tolist):
        return value.tolist()
    if isinstance(value, (os.PathLike, type)):
        return str(value)
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    return repr(value)


class MetricsFile:
    """One rank's append-only metrics log: ``{"kind": ..., "time": ..., **fields}`` per line.

    Each :meth:`write` is one ``write`` of one complete line, then a flush: a crash (or a
    kill) loses at most that line. Opening an existing file appends (a resumed run continues
    its log) after cutting off a truncated last line a crash left, so new records never join
    a fragment.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _cut_partial_last_line(self.path)
        self._f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (kept open: a log)

    def write(self, kind: str, **fields: object) -> None:
        """Append one record of ``kind`` stamped with the wall-clock time, and flush it."""
        if self._f.closed:
            return  # written after close (an exit path): nothing to keep it in
        record = {"kind": kind, "time": time.time(), **fields}
        line = json.dumps(record, default=_jsonable, separators=(",", ":"))
        with disk_full_is_clear(self.path):
            self._f.write(line + "\n")
            self._f.flush()

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()

    def __enter__(self) -> MetricsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _cut_partial_last_line(path: Path) -> None:
    """Truncate ``path`` after its last newline (what a crash mid-line left is no record)."""
    try:
        with open(path, "rb+") as f:
            size = f.seek(0, os.SEEK_END)
            if size == 0:
                return
            f.seek(size - 1)
            if f.read(1) == b"\n":
                return
            tail = min(size, 1 << 20)
            f.seek(size - tail)
            end = f.read(tail).rfind(b"\n")
            f.truncate(size - tail + end + 1 if end >= 0 else (0 if tail == size else size))
    except FileNotFoundError:
        return


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The records of a metrics file, in order; a truncated (crash-cut) last line is skipped.

    A corrupt line anywhere else is a :class:`~zerotron.errors.DataError` naming it.
    """
    lines = Path(path).read_text(encoding="utf-8", errors="replace").split("\n")
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):  # no newline after it: the line a crash cut
                continue
            raise DataError(
                f"a metrics file line is not a JSON record: {line[:80]!r}",
                where=f"{path}:{number}",
                fix="remove that line (two writers on one rank file?) and run again",
            ) from None
        if isinstance(record, dict) and "kind" in record:
            records.append(record)
    return records
