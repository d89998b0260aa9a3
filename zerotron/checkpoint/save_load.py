"""Write and read checkpoints atomically, with both trackers and a metadata.json per tag.

A save assembles every rank's files in ``<save>/.<tag>.tmp/``, then one writer rank fsyncs it,
renames it to ``<save>/<tag>/`` and only then updates the trackers. A process killed at any
point leaves the previous checkpoint complete and the trackers pointing at it; the next save
cleans up what the killed one left behind.

Reading is :mod:`zerotron.checkpoint.load`'s (its names are re-exported here). What goes into
the files is the caller's business (the Engine's): this module takes a mapping
``relative path -> object`` and checks that each object loads back with
``torch.load(weights_only=True)`` before writing it.
"""

from __future__ import annotations

import collections
import json
import os
import platform
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

import zerotron
from zerotron.checkpoint import layout
from zerotron.checkpoint.async_save import AsyncCheckpointWriter, snapshot
from zerotron.checkpoint.checksums import (
    collect_checksums,
    record_checksum,
)
from zerotron.checkpoint.load import (  # noqa: F401 (the loading half, re-exported here)
    _check_relpath,
    _list_files,
    load_file,
    read_latest_tag,
    resolve_tag,
)
from zerotron.checkpoint.metadata import (  # noqa: F401 (re-exported: its old home)
    check_metadata,
    read_metadata,
)
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
