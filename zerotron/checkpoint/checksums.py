"""Per-file checksums of a checkpoint: recorded while a tag is assembled, checked on load.

Every file of a tag gets ``{"sha256": HEX, "size": BYTES}`` in metadata.json's ``checksums``
(path relative to the tag directory -> entry). The rank that writes a file hashes it right after
writing, while its pages are still cached, and leaves the result in a small sidecar under the
temporary tag directory (``.checksums/``); the writer rank collects every sidecar when it
commits the tag (see :func:`zerotron.checkpoint.save_load.commit_tag`) and hashes any file that
has none. So no rank reads another rank's files, and no collective is needed beyond the save's
barrier.

Pure file functions: no torch, no processes.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

ALGORITHM = "sha256"
SIDECAR_DIR = ".checksums"  # inside the temporary tag directory; removed before the commit
_CHUNK = 1 << 20


def file_checksum(path: str | os.PathLike) -> dict[str, Any]:
    """``{"sha256": HEX, "size": BYTES}`` of the file at ``path`` (read in 1 MiB chunks)."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return {ALGORITHM: digest.hexdigest(), "size": size}


def _sidecar(tmp_dir: Path, relpath: str) -> Path:
    # Named by a hash of the path: one flat directory, no clash between "a/b" and "a_b".
    return tmp_dir / SIDECAR_DIR / (hashlib.sha1(relpath.encode()).hexdigest() + ".json")


def record_checksum(tmp_dir: str | os.PathLike, relpath: str) -> dict[str, Any]:
    """Hash ``tmp_dir/relpath`` (a file just written into a temporary tag directory) and leave
    the result for the commit; returns the entry. Optional: the commit hashes what has none."""
    tmp_dir = Path(tmp_dir)
    entry = file_checksum(tmp_dir / relpath)
    side = _sidecar(tmp_dir, relpath)
    side.parent.mkdir(exist_ok=True)
    side.write_text(json.dumps({"path": relpath, **entry}))
    return entry


def collect_checksums(tmp_dir: str | os.PathLike, files: list[str]) -> dict[str, dict[str, Any]]:
    """The checksum entry of every file in ``files`` (relative to ``tmp_dir``).

    A recorded entry is used when its size still matches the file; any other file is hashed
    here. Removes the sidecar directory (it is no part of the checkpoint).
    """
    tmp_dir = Path(tmp_dir)
    out: dict[str, dict[str, Any]] = {}
    for relpath in files:
        entry = None
        try:
            side = json.loads(_sidecar(tmp_dir, relpath).read_text())
            if side.get("path") == relpath and side.get("size") == os.path.getsize(
                tmp_dir / relpath
            ):
                entry = {ALGORITHM: side[ALGORITHM], "size": side["size"]}
        except (OSError, ValueError, KeyError, AttributeError):
            pass  # none recorded, or a partial one: hash the file itself
        out[relpath] = entry or file_checksum(tmp_dir / relpath)
    side_dir = tmp_dir / SIDECAR_DIR
    if side_dir.is_dir():
        for p in side_dir.iterdir():
            p.unlink(missing_ok=True)
        side_dir.rmdir()
    return out


def check_file(path: str | os.PathLike, entry: Any, *, digest: bool = True) -> str | None:
    """What is wrong with the file at ``path`` against its recorded ``entry`` (None: nothing).

    Checks the size first (a stat: catches truncation), then, if ``digest``, the sha256.
    """
    path = Path(path)
    if not isinstance(entry, dict) or not isinstance(entry.get(ALGORITHM), str):
        return f"its checksum entry in metadata.json is malformed ({str(entry)[:60]})"
    if not path.is_file():
        return "missing"
    size = path.stat().st_size
    if isinstance(entry.get("size"), int) and size != entry["size"]:
        return f"size is {size} bytes, metadata.json records {entry['size']}"
    if not digest:
        return None
    actual = file_checksum(path)[ALGORITHM]
    if actual != entry[ALGORITHM]:
        return f"sha256 is {actual[:16]}..., metadata.json records {entry[ALGORITHM][:16]}..."
    return None
