"""``--save-keep-last N``: delete all but the N newest complete checkpoints of a save directory.

Runs after a new tag is committed (so at least one complete checkpoint always exists), on the
writer rank only. The tag the trackers name is never deleted, whatever its age; tags that are
not complete (``zerotron checkpoint verify`` reports them) and directories without a
metadata.json are left for the user. A tag is first renamed to ``.<tag>.deleting`` (one atomic
step, so no half-deleted directory ever looks like a checkpoint), then removed; a kill in between
leaves only that hidden name, which the next save cleans up.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from zerotron.checkpoint import layout
from zerotron.checkpoint.verify import tag_problems, tags_newest_first
from zerotron.fileio import fsync_dir

DELETING_SUFFIX = ".deleting"


def tags_to_delete(save_dir: str | os.PathLike, keep_last: int, latest: str | None) -> list[str]:
    """The complete tags beyond the ``keep_last`` newest, never ``latest`` (oldest last)."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    complete = [
        t
        for t in tags_newest_first(save_dir)
        if not tag_problems(save_dir, t, checksums=False, implied=False)
    ]
    return [t for t in complete[keep_last:] if t != latest]


def prune_tags(save_dir: str | os.PathLike, keep_last: int, latest: str | None) -> list[str]:
    """Delete what :func:`tags_to_delete` names; returns the deleted tags."""
    save_dir = Path(save_dir)
    deleted = []
    for tag in tags_to_delete(save_dir, keep_last, latest):
        doomed = save_dir / f".{tag}{DELETING_SUFFIX}"
        os.replace(layout.tag_dir(save_dir, tag), doomed)
        fsync_dir(save_dir)
        shutil.rmtree(doomed, ignore_errors=True)
        deleted.append(tag)
    return deleted
