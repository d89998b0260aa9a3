"""Read checkpoints: which tag to load (trackers, completeness, fallback), and one file safely.

Loading checks a tag before reading it and each file as it is read (:mod:`zerotron.checkpoint.
verify`, :mod:`zerotron.checkpoint.checksums`); every file is read with
``torch.load(weights_only=True)``. Writing is :mod:`zerotron.checkpoint.save_load`'s.
"""

from __future__ import annotations

import os
import pickle
import warnings
from pathlib import Path, PurePosixPath
from typing import Any

import torch

from zerotron.checkpoint import layout, verify
from zerotron.checkpoint.checksums import SIDECAR_DIR, check_file
from zerotron.checkpoint.metadata import read_metadata
from zerotron.errors import CheckpointError
from zerotron.fileio import recover_dir


def _check_relpath(relpath: str) -> str:
    p = PurePosixPath(relpath)
    if p.is_absolute() or ".." in p.parts or not p.parts or str(p) == layout.METADATA_FILE:
        raise ValueError(f"checkpoint file {relpath!r} must be a relative path inside the tag")
    return str(p)


def _list_files(root: Path) -> list[str]:
    """Every file under ``root`` but the checksum sidecars, relative and sorted."""
    return sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.is_file() and p.relative_to(root).parts[0] != SIDECAR_DIR
    )


def read_latest_tag(load_dir: str | os.PathLike) -> str | None:
    """The tag the trackers name: DeepSpeed's ``latest`` if present, else Megatron's tracker.

    None when ``load_dir`` has neither tracker (no checkpoint was ever completed there).
    """
    load_dir = Path(load_dir)
    latest = layout.deepspeed_tracker(load_dir)
    if latest.is_file():
        tag = _read_tracker(latest)
        if not tag:
            raise CheckpointError(
                "the tracker file is empty", where=str(latest), fix="write the tag to load into it"
            )
        return layout.validate_tag(tag)
    tracker = layout.megatron_tracker(load_dir)
    if tracker.is_file():
        text = _read_tracker(tracker)
        if text == layout.RELEASE_TAG:
            return text
        try:
            iteration = int(text)
            if not 0 <= iteration < 10**15:  # beyond that the tag is not a usable file name
                raise ValueError(text)
            return layout.tag_for_iteration(iteration)
        except ValueError:
            raise CheckpointError(
                f"the tracker holds {text!r}, expected an iteration number or 'release'",
                where=str(tracker),
                fix="write the iteration to load (e.g. 600) into it",
            ) from None
    return None


def _read_tracker(path: Path) -> str:
    """A tracker file's text: one line of UTF-8, the tag or the iteration."""
    try:
        return path.read_bytes().decode("utf-8").strip()
    except UnicodeDecodeError as e:
        raise CheckpointError(
            f"the tracker file is not text (byte {e.start} is {e.object[e.start : e.start + 1]!r})",
            where=str(path),
            fix="write the tag (e.g. iter_0000600) or the iteration to load into it, or delete "
            "it and name the tag explicitly",
        ) from None
    except OSError as e:
        raise CheckpointError(
            f"cannot read the tracker file: {e.strerror or e}", where=str(path)
        ) from None


def _available_tags(load_dir: Path) -> list[str]:
    if not load_dir.is_dir():
        return []
    return sorted(p.name for p in load_dir.iterdir() if p.is_dir() and not p.name.startswith("."))


def resolve_tag(load_dir: str | os.PathLike, tag: str | None = None) -> str:
    """The tag to load: ``tag`` if given, else the trackers'; checks that it is complete.

    Complete: every file metadata.json records is there with its recorded size (stat calls,
    :mod:`zerotron.checkpoint.verify`; :func:`load_file` checks each file's checksum as it
    reads it, and a missing rank file is named by the loader that needs it). An incomplete
    ``tag`` is a :class:`CheckpointError` naming the files; when the trackers' tag is
    incomplete (or gone), the newest complete tag is loaded instead, with a warning naming the
    broken one. Also finishes a replacement of that tag that a killed save left half done.
    """
    explicit = tag is not None
    tag = _tracked_tag(load_dir, tag)
    root = layout.tag_dir(load_dir, tag)
    if root.is_dir() and not (root / layout.METADATA_FILE).is_file():
        return tag  # written by another tool: nothing recorded to check it against
    problems = verify.tag_problems(load_dir, tag, checksums=False, implied=False)
    if not problems:
        return tag
    if explicit:
        raise verify.problems_error(load_dir, tag, problems)
    other = verify.newest_complete_tag(load_dir, exclude={tag})
    if other is None:
        raise verify.problems_error(
            load_dir,
            tag,
            problems,
            fix="no other complete checkpoint is there: re-create it, or start without --load",
        )
    warnings.warn(
        f"checkpoint '{tag}' in {load_dir}, which the tracker names, is corrupt or incomplete "
        f"({problems[0]}{' ...' if len(problems) > 1 else ''}); loading '{other}', the newest "
        "complete one",
        stacklevel=3,
    )
    return other


def _tracked_tag(load_dir: str | os.PathLike, tag: str | None) -> str:
    """``tag``, or the trackers' one; its directory restored if a killed save moved it."""
    load_dir = Path(load_dir)
    from_tracker = tag is None
    if tag is None:
        tag = read_latest_tag(load_dir)
        if tag is None:
            found = _available_tags(load_dir)
            raise CheckpointError(
                f"no checkpoint to load: found neither '{layout.DEEPSPEED_TRACKER}' nor "
                f"'{layout.MEGATRON_TRACKER}'"
                + (f" (directories present: {', '.join(found)})" if found else ""),
                where=str(load_dir),
                fix="pass the directory given to --save, name a tag explicitly, or start "
                "without --load",
            )
    final = layout.tag_dir(load_dir, tag)
    if not final.is_dir():
        try:
            recover_dir(final)
        except OSError as e:
            raise CheckpointError(
                f"checkpoint '{tag}' is only present as a leftover of an interrupted save, and "
                f"restoring it failed: {e}",
                where=str(load_dir),
                fix=f"rename the '.{tag}.old-*' directory there to '{tag}'",
            ) from e
    if not final.is_dir() and from_tracker and verify.tags_newest_first(load_dir):
        return tag  # the trackers name a tag that is gone: resolve_tag falls back
    if not final.is_dir():
        found = _available_tags(load_dir)
        raise CheckpointError(
            f"checkpoint '{tag}' does not exist"
            + (f"; present: {', '.join(found)}" if found else ""),
            where=str(final),
            fix="name an existing tag, or fix the tracker file in the load directory",
        )
    return tag


def load_file(load_dir: str | os.PathLike, tag: str, relpath: str) -> Any:
    """``torch.load`` one file of a checkpoint, safely (weights_only) and onto the CPU."""
    final = layout.tag_dir(load_dir, tag)
    path = final / _check_relpath(relpath)
    if not path.is_file():
        present = _list_files(final) if final.is_dir() else []
        raise CheckpointError(
            f"checkpoint file '{relpath}' is missing"
            + (f"; the checkpoint has: {', '.join(present)}" if present else ""),
            where=str(path),
            fix="load with the parallel layout it was saved with (see 'layout' in its "
            "metadata.json), or reshard it to this one",
        )
    _check_checksum(final, relpath, path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "weights_only" in str(e) or "Weights only" in str(e):
            raise CheckpointError(
                "the file holds Python objects that safe loading (weights_only=True) refuses",
                where=str(path),
                fix="zerotron loads only tensors and plain data; re-save the weights with a "
                "tool you trust, or convert them with `zerotron convert`",
            ) from e
        raise _corrupt(path, e) from e
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise _corrupt(path, e) from e


# metadata.json's checksums per tag directory, keyed by the file's identity (a re-save
# replaces it), and the tags already reported as having none.
_SUMS_CACHE: dict[tuple[str, int, int], dict[str, Any] | None] = {}
_WARNED_UNCHECKED: set[str] = set()


def _checksums_of(final: Path) -> dict[str, Any] | None:
    """The tag's recorded checksums; None for a checkpoint saved before they were recorded."""
    st = (final / layout.METADATA_FILE).stat()
    key = (str(final), st.st_mtime_ns, st.st_ino)
    if key not in _SUMS_CACHE:
        sums = read_metadata(final.parent, final.name).get("checksums")
        _SUMS_CACHE[key] = sums if isinstance(sums, dict) else None
    return _SUMS_CACHE[key]


def _check_checksum(final: Path, relpath: str, path: Path) -> None:
    """Refuse a file whose size or sha256 differs from what its tag's metadata.json records."""
    if not (final / layout.METADATA_FILE).is_file():
        return  # a checkpoint written by another tool
    sums = _checksums_of(final)
    if sums is None:
        if str(final) not in _WARNED_UNCHECKED:
            _WARNED_UNCHECKED.add(str(final))
            warnings.warn(
                f"checkpoint {final} records no checksums (saved before zerotron recorded "
                "them): its files are loaded unchecked",
                stacklevel=4,
            )
        return
    if relpath not in sums:
        return  # added beside the checkpoint after it was saved: nothing to check it against
    what = check_file(path, sums[relpath])
    if what is not None:
        raise CheckpointError(
            f"checkpoint file '{relpath}' is corrupt: {what}",
            where=str(path),
            fix=f"load an earlier tag: `zerotron checkpoint verify {final.parent}` lists the "
            f"good ones; name one (--tag) or write it into {final.parent / 'latest'}",
        )


def _corrupt(path: Path, e: Exception) -> CheckpointError:
    first_line = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return CheckpointError(
        f"cannot read the checkpoint file ({type(e).__name__}: {first_line})",
        where=str(path),
        fix="the file is truncated or corrupt: load an earlier checkpoint (pass its tag) or "
        "re-create this one",
    )
