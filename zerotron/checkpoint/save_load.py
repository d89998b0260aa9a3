"""Write and read checkpoints atomically, with both trackers and a metadata.json per tag.

A save assembles every rank's files in ``<save>/.<tag>.tmp/``, then one writer rank fsyncs it,
renames it to ``<save>/<tag>/`` and only then updates the trackers. A process killed at any
point leaves the previous checkpoint complete and the trackers pointing at it; the next save
cleans up what the killed one left behind.

What goes into the files is the caller's business (the Engine's): this module takes a mapping
``relative path -> object`` and checks that each object loads back with
``torch.load(weights_only=True)`` before writing it.
"""

from __future__ import annotations

import collections
import json
import os
import pickle
import platform
import shutil
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import torch

import zerotron
from zerotron.checkpoint import layout, verify
from zerotron.checkpoint.async_save import AsyncCheckpointWriter, snapshot
from zerotron.checkpoint.checksums import (
    SIDECAR_DIR,
    check_file,
    collect_checksums,
    record_checksum,
)
from zerotron.checkpoint.metadata import read_metadata
from zerotron.checkpoint.retention import DELETING_SUFFIX, prune_tags
from zerotron.distributed import watchdog
from zerotron.errors import CheckpointError, DiskFullError, ZerotronError
from zerotron.fileio import (
    atomic_write_text,
    check_free_space,
    commit_dir,
    disk_full_is_clear,
    disk_write_error,
    fsync_dir,
    recover_dir,
)

FORMAT_VERSION = 1

# Types torch.load(weights_only=True) accepts as leaves (containers are checked separately).
_SAFE_LEAVES = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    torch.Tensor,
    torch.dtype,
    torch.device,
    torch.Size,
)


# ---------------------------------------------------------------------------------------------
# What may be saved


def to_safe(obj: Any) -> Any:
    """A copy of ``obj`` with NumPy arrays/scalars and paths turned into tensors/primitives.

    Use it on objects from libraries that hand out NumPy values (a NumPy array becomes a tensor,
    a NumPy scalar a Python number, a path a string); the result passes :func:`check_safe`.
    """
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(obj)).clone()
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if isinstance(obj, collections.OrderedDict):
        return collections.OrderedDict((k, to_safe(v)) for k, v in obj.items())
    if isinstance(obj, Mapping):
        return {k: to_safe(v) for k, v in obj.items()}
    if isinstance(obj, (set, frozenset)):  # weights_only refuses frozenset
        return {to_safe(v) for v in obj}
    if isinstance(obj, tuple):  # a namedtuple becomes a plain tuple
        return tuple(to_safe(v) for v in obj)
    if isinstance(obj, list):
        return [to_safe(v) for v in obj]
    return obj


def check_safe(obj: Any, where: str = "") -> None:
    """Raise :class:`CheckpointError` naming the first value weights_only loading would refuse."""
    stack: list[tuple[str, Any]] = [("", obj)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, _SAFE_LEAVES):
            continue
        if type(value) in (dict, collections.OrderedDict):
            for k, v in value.items():
                if not isinstance(k, (str, int, float, bool, type(None), tuple)):
                    stack.append((f"{path}[{k!r}] (the key)", k))
                stack.append((f"{path}[{k!r}]", v))
        elif type(value) in (list, tuple, set):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(value))
        else:
            raise CheckpointError(
                f"cannot save {type(value).__module__}.{type(value).__qualname__} at "
                f"{path or 'top level'}: checkpoints are loaded with "
                "torch.load(weights_only=True), "
                "which accepts only tensors, numbers, strings and dicts/lists/tuples of them",
                where=where or None,
                fix="convert it first (zerotron.checkpoint.to_safe turns NumPy values into "
                "tensors; a config object into a dict with .model_dump() or dataclasses.asdict)",
            )


# ---------------------------------------------------------------------------------------------
# Saving


def build_metadata(
    *,
    model_config: Mapping[str, Any],
    vocab_size: int,
    padded_vocab_size: int,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    data_parallel_size: int = 1,
    zero_stage: int = 0,
    tokenizer: Mapping[str, Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """The metadata.json a checkpoint needs so tools can reshard or export it without flags.

    ``model_config`` is the model's config as a dict (its Megatron flag names as keys);
    ``vocab_size`` the tokenizer's (unpadded) vocabulary, ``padded_vocab_size`` the rows of the
    embedding. :func:`save_checkpoint` adds tag, iteration, versions and the list of files.
    """
    return {
        "layout": {
            "tensor_model_parallel_size": tensor_model_parallel_size,
            "pipeline_model_parallel_size": pipeline_model_parallel_size,
            "data_parallel_size": data_parallel_size,
            "zero_stage": zero_stage,
        },
        "model": dict(model_config),
        "vocab": {"size": vocab_size, "padded_size": padded_vocab_size},
        "tokenizer": dict(tokenizer or {}),
        **extra,
    }


def _clean_stale(save_dir: Path) -> None:
    """Undo or delete what killed saves left in ``save_dir`` (only the writer rank calls this)."""
    for name in os.listdir(save_dir):
        if not name.startswith("."):
            continue
        path = save_dir / name
        if name.endswith(".tmp") and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        elif ".old-" in name and path.is_dir():
            # Left by commit_dir: restore it if its replacement never arrived, else delete it.
            recover_dir(save_dir / name[1 : name.rindex(".old-")])
        elif name.endswith(DELETING_SUFFIX) and path.is_dir():  # a killed --save-keep-last
            shutil.rmtree(path, ignore_errors=True)
        elif ".tmp-" in name and path.is_file():  # an unfinished atomic tracker write
            path.unlink(missing_ok=True)


def _check_relpath(relpath: str) -> str:
    p = PurePosixPath(relpath)
    if p.is_absolute() or ".." in p.parts or not p.parts or str(p) == layout.METADATA_FILE:
        raise ValueError(f"checkpoint file {relpath!r} must be a relative path inside the tag")
    return str(p)


def _write_file(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with disk_full_is_clear(path), open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())  # by the rank that wrote it: on a shared filesystem that matters


def tensor_bytes(obj: Any) -> int:
    """Bytes of tensor data ``obj`` holds (each storage once): what torch.save will write."""
    seen: set[tuple[int, int]] = set()
    total = 0
    stack = [obj]
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
        elif isinstance(value, Mapping):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple, set)):
            stack.extend(value)
    return total


# Room for what is not tensor data (pickled structure, zip headers, metadata.json).
_SPACE_MARGIN = 1024 * 1024


def _space_problem(save_dir: Path, files: Mapping[str, Any]) -> DiskFullError | None:
    """This rank's files do not fit in the free space under ``save_dir`` (None: they do)."""
    if not files:
        return None
    needed = sum(tensor_bytes(obj) for obj in files.values()) + _SPACE_MARGIN
    try:
        check_free_space(save_dir, needed, f"checkpoint files {', '.join(sorted(files))}")
    except DiskFullError as e:
        e.fix = "free space or save elsewhere (--save); nothing was written and the previous "
        e.fix += "checkpoint is kept"
        return e
    return None


def _discard(tmp: Path, files: Mapping[str, Any], is_writer: bool) -> None:
    """Remove what a failed save wrote: the writer the whole temp dir, others their files."""
    if is_writer:
        shutil.rmtree(tmp, ignore_errors=True)
        return
    for relpath in files:
        (tmp / relpath).unlink(missing_ok=True)


def _cleanup(tmp: Path, files: Mapping[str, Any], is_writer: bool) -> Callable[[], None]:
    return lambda: _discard(tmp, files, is_writer)


def _write_failure(e: BaseException, tmp: Path) -> ZerotronError:
    """A clean error for a failed write; other errors stay as they are (bugs keep tracebacks)."""
    if isinstance(e, ZerotronError):
        return e
    err = disk_write_error(tmp, e)
    if err is None:
        raise e
    err.fix = "free space or save elsewhere (--save); nothing partial was kept and the "
    err.fix += "previous checkpoint is still there"
    return err


def _agree(
    any_rank: Callable[[bool], bool] | None,
    error: ZerotronError | None,
    happened: str,
    cleanup: Callable[[], None] | None = None,
) -> None:
    """Raise ``error`` here, or (with ``any_rank``) an error on every rank if any rank has one."""
    failed = any_rank(error is not None) if any_rank is not None else error is not None
    if not failed:
        return
    if cleanup is not None:
        cleanup()
    if error is not None:
        raise error
    raise CheckpointError(
        f"another rank {happened}; this rank stopped with it",
        fix="see that rank's error; nothing partial was kept and the previous checkpoint is "
        "still there",
    )


def begin_tag(save_dir: str | os.PathLike, tag: str) -> Path:
    """Start assembling ``<save_dir>/<tag>/``: returns its empty temporary directory.

    Cleans what killed saves left in ``save_dir`` first. Write the tag's files into the returned
    directory (optionally :func:`~zerotron.checkpoint.checksums.record_checksum` each one right
    after writing it), then call :func:`commit_tag`. One process calls this per tag (in a job,
    the writer rank, before the others write).
    """
    save_dir = Path(save_dir)
    tmp = layout.temp_tag_dir(save_dir, tag)
    save_dir.mkdir(parents=True, exist_ok=True)
    _clean_stale(save_dir)
    tmp.mkdir()
    return tmp


def commit_tag(
    save_dir: str | os.PathLike,
    tag: str,
    metadata: Mapping[str, Any] | None = None,
    *,
    iteration: int | None = None,
    save_latest: bool = True,
) -> Path:
    """Finish the tag :func:`begin_tag` started: checksums, metadata.json, rename, trackers.

    Records every file of the temporary directory in metadata.json (``files``, and
    ``checksums``: path -> ``{"sha256", "size"}``, from the recorded entries or hashed here)
    with ``metadata``, tag, ``iteration`` (default: the one in a Megatron tag), versions and the
    time; fsyncs everything, renames the directory to ``<save_dir>/<tag>/`` (replacing an older
    one of that tag) and, if ``save_latest``, updates the trackers last. On failure the
    temporary directory is removed and the previous checkpoint and trackers stay as they were.
    Returns the tag directory.
    """
    save_dir = Path(save_dir)
    tmp = layout.temp_tag_dir(save_dir, tag)
    final = layout.tag_dir(save_dir, tag)
    if not tmp.is_dir():
        raise CheckpointError(
            "there is no checkpoint being assembled for this tag",
            where=str(tmp),
            fix="call begin_tag(save_dir, tag) and write the files into the directory it returns",
        )
    if iteration is None:
        iteration = layout.iteration_from_tag(tag)
    try:
        files = _list_files(tmp)
        meta = dict(metadata or {})
        meta.update(
            format_version=FORMAT_VERSION,
            tag=tag,
            iteration=iteration,
            files=files,
            checksums=collect_checksums(tmp, files),
            versions={
                "zerotron": zerotron.__version__,
                "torch": torch.__version__,
                "python": platform.python_version(),
            },
            saved_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        )
        with disk_full_is_clear(tmp):
            (tmp / layout.METADATA_FILE).write_text(json.dumps(meta, indent=2) + "\n")
            commit_dir(tmp, final)  # fsyncs every file, then renames
            if save_latest:
                write_trackers(save_dir, tag)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, (OSError, RuntimeError)):
            raise _write_failure(e, tmp) from e
        raise
    return final


def _list_files(root: Path) -> list[str]:
    """Every file under ``root`` but the checksum sidecars, relative and sorted."""
    return sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.is_file() and p.relative_to(root).parts[0] != SIDECAR_DIR
    )


def write_trackers(save_dir: str | os.PathLike, tag: str) -> None:
    """Point both trackers at ``tag`` (each written atomically).

    Megatron's tracker can only name ``iter_XXXXXXX`` or ``release`` tags; for any other tag it is
    removed, so that no tool follows it to an older checkpoint than DeepSpeed's ``latest`` names.
    """
    save_dir = Path(save_dir)
    iteration = layout.iteration_from_tag(tag)
    megatron = layout.megatron_tracker(save_dir)
    if iteration is not None or tag == layout.RELEASE_TAG:
        atomic_write_text(megatron, str(iteration) if iteration is not None else tag)
    elif megatron.exists():
        megatron.unlink()
        fsync_dir(save_dir)
    atomic_write_text(layout.deepspeed_tracker(save_dir), tag)


def save_checkpoint(
    save_dir: str | os.PathLike,
    tag: str,
    files: Mapping[str, Any],
    metadata: Mapping[str, Any] | None = None,
    *,
    iteration: int | None = None,
    save_latest: bool = True,
    is_writer: bool = True,
    barrier: Callable[[], None] | None = None,
    any_rank: Callable[[bool], bool] | None = None,
    keep_last: int | None = None,
    writer: AsyncCheckpointWriter | None = None,
) -> Path:
    """Save ``files`` (path relative to the tag directory -> object) as ``<save_dir>/<tag>/``.

    Every rank calls this with its own ``files`` (possibly none) and the same ``tag``; exactly one
    rank passes ``is_writer=True``: it writes metadata.json (``metadata`` plus tag, iteration,
    versions and the list of every rank's files), renames the directory into place (replacing an
    older one of the same tag) and, if ``save_latest``, updates the trackers last. ``barrier``
    synchronizes the ranks (e.g. ``torch.distributed.barrier``); a single process passes none.
    ``iteration`` defaults to the one in a Megatron tag. Returns the tag directory.

    ``any_rank(flag)`` (a collective: whether ``flag`` holds on any rank) lets every rank stop
    together when one has no room or fails to write; each rank first checks that its files fit
    in the free space. A failed save removes its temporary directory and leaves the previous
    checkpoint and the trackers as they were.

    ``keep_last`` N: once the tag is committed, delete all but the N newest complete tags
    (never the one the trackers name; :mod:`zerotron.checkpoint.retention`). ``writer``: write
    in the background (:mod:`zerotron.checkpoint.async_save`): this returns once the tensors
    are copied and the save is started (after committing the one before); the tag exists
    when the writer commits it.
    """
    if not is_writer and barrier is None:
        raise ValueError("a non-writer rank needs a barrier to wait for the writer")
    sync = barrier or (lambda: None)
    if writer is not None:
        writer.wait()  # one save at a time: the one in flight is committed first
    save_dir = Path(save_dir)
    final = layout.tag_dir(save_dir, tag)
    tmp = layout.temp_tag_dir(save_dir, tag)
    if iteration is None:
        iteration = layout.iteration_from_tag(tag)
    for relpath, obj in files.items():  # before anything is written: fail without side effects
        check_safe(obj, where=f"{final}/{_check_relpath(relpath)}")
    if metadata is not None:
        try:
            json.dumps(metadata)
        except (TypeError, ValueError) as e:
            raise CheckpointError(
                f"metadata is not JSON-serializable: {e}", where=str(final)
            ) from e

    _agree(any_rank, _space_problem(save_dir, files), "had no room for its checkpoint files")
    if is_writer:
        begin_tag(save_dir, tag)
    sync()  # nobody writes into tmp before the writer has emptied it

    def write(items: Mapping[str, Any]) -> ZerotronError | None:
        """This rank's files into tmp: None, or the failure (what it wrote removed)."""
        path = tmp
        try:
            for relpath, obj in items.items():
                path = tmp / _check_relpath(relpath)
                _write_file(path, obj)
                record_checksum(tmp, _check_relpath(relpath))  # hashed while its pages are hot
        except (OSError, RuntimeError, ZerotronError) as e:
            _discard(tmp, items, is_writer)
            return _write_failure(e, path)
        return None

    def commit(failure: BaseException | None) -> None:
        """Every rank wrote (or one failed: all raise); the writer renames, then prunes."""
        if failure is not None and not isinstance(failure, ZerotronError):
            if any_rank is not None:
                any_rank(True)  # the peers stop too, before this rank raises the bug
            raise failure
        if any_rank is None:
            if failure is not None:
                raise failure  # before the barrier: the writer must not commit without these
            sync()
        else:
            _agree(any_rank, failure, "could not write its checkpoint files",
                   _cleanup(tmp, files, is_writer))  # fmt: skip
        if is_writer:
            commit_tag(save_dir, tag, metadata, iteration=iteration, save_latest=save_latest)
            if keep_last:
                prune_tags(save_dir, keep_last, read_latest_tag(save_dir))
        sync()  # nobody goes on (e.g. to load it, or to exit) before the checkpoint is complete

    if writer is None:
        # Its peers may wait at the next barrier for as long as this takes: not a hang.
        with watchdog.busy("writing its checkpoint files"):
            failure = write(files)
        commit(failure)
    else:
        snap = snapshot(files)  # training may change the tensors as soon as this returns
        writer.start(lambda: write(snap), commit, any_rank, what=str(final))
    return final


# ---------------------------------------------------------------------------------------------
# Loading


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
