"""Megatron-LM checkpoint files on disk: find them, read them safely, write them.

Two on-disk forms, both under a root with ``latest_checkpointed_iteration.txt`` (an iteration or
``release``) naming ``iter_XXXXXXX/`` or ``release/``:

- per-rank files ``mp_rank_TT[_PPP]/model_optim_rng.pt`` (TT the tensor-, PPP the pipeline-
  parallel rank; no ``_PPP`` when the pipeline size is 1), each a ``torch.save`` of a dict with
  ``model`` (or ``model0``, ``model1``... with virtual pipeline stages), ``args`` (Megatron-LM's
  ``argparse.Namespace``), ``checkpoint_version``, ``iteration``, ``rng_state``...;
- ``torch_dist``: megatron-core's ``dist_checkpointing`` directory, a
  ``torch.distributed.checkpoint`` save (``.metadata``, ``__R_T.distcp``) of global tensors,
  with ``common.pt`` (the non-sharded entries, ``args`` among them) and megatron's own
  ``metadata.json`` (``"sharded_backend": "torch_dist"``).

Loading is safe: ``torch.load(weights_only=True)`` with :data:`ALLOWED_GLOBALS`, the non-tensor
types Megatron-LM puts in these files (``argparse.Namespace``, megatron-core enums, numpy's RNG
state); any other type is refused with a :class:`CheckpointError` naming the file and the type.
The ``.metadata`` of a ``torch_dist`` directory is read by an unpickler that admits only
``torch.distributed.checkpoint``'s metadata classes, and only tensors are requested from it
(its pickled byte entries, such as layers' ``_extra_state``, are never unpickled).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import warnings
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from zerotron.errors import CheckpointError
from zerotron.fileio import atomic_dir, atomic_write_text, commit_dir

TRACKER = "latest_checkpointed_iteration.txt"
MODEL_FILE = "model_optim_rng.pt"
COMMON_FILE = "common.pt"
# What Megatron-DeepSpeed's saves (DeepSpeed's engine) add: DeepSpeed's tracker and model states.
DEEPSPEED_TRACKER = "latest"
DEEPSPEED_MODEL_STATES = "mp_rank_00_model_states.pt"
_RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?")


class MegatronEnum:
    """Stands for a megatron enum member in a loaded ``args`` (its value; megatron unneeded)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"MegatronEnum({self.value!r})"


# Enums Megatron-LM stores in ``args`` (model_type, attention_backend...), old and new homes.
_ENUM_NAMES = ("ModelType", "AttnBackend", "AttnMaskType", "AttnType", "LayerType", "Fp8Recipe")
_ENUMS = [
    f"{module}.{name}"
    for module in (
        "megatron.core.enums",
        "megatron.core.transformer.enums",
        "megatron.model.enums",
        "megatron.legacy.model.enums",
    )
    for name in _ENUM_NAMES
]


def _numpy_globals() -> list:
    """numpy's RNG state (``np.random.get_state()`` in ``rng_state``): arrays and dtypes."""
    try:
        import numpy as np
    except ImportError:  # files with numpy state are then refused by name
        return []
    reconstruct = np._core.multiarray._reconstruct if hasattr(np, "_core") else None
    if reconstruct is None:  # numpy < 2
        reconstruct = np.core.multiarray._reconstruct
    return [
        (reconstruct, "numpy.core.multiarray._reconstruct"),
        (reconstruct, "numpy._core.multiarray._reconstruct"),
        np.ndarray,
        np.dtype,
        *(type(np.dtype(t)) for t in ("uint32", "int64", "float64")),
    ]


def allowed_globals() -> list:
    """What ``weights_only`` loading admits beyond tensors and plain data, in torch's form."""
    # MegatronEnum itself too: a file zerotron loaded and saved again holds the stand-ins.
    return [
        argparse.Namespace,
        MegatronEnum,
        *((MegatronEnum, name) for name in _ENUMS),
        *_numpy_globals(),
    ]


ALLOWED_GLOBALS_DOC = [
    "argparse.Namespace",
    f"megatron's enums ({', '.join(_ENUM_NAMES)})",
    "numpy arrays and dtypes (RNG state)",
]


def load_safe(path: str | os.PathLike, mmap: bool = False) -> Any:
    """``torch.load`` one Megatron file onto the CPU, admitting only :func:`allowed_globals`
    (``mmap``: its tensors mapped, not read, for a look at the rest)."""
    path = Path(path)
    try:
        with torch.serialization.safe_globals(allowed_globals()):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        text = str(e)
        if "weights_only" not in text and "Weights only" not in text:
            raise _corrupt(path, e) from None
        m = re.search(r"GLOBAL ([\w.]+)", text) or re.search(r"function <[^>]*?([\w.]+)>", text)
        kind = m.group(1) if m else "an unlisted Python object"
        raise CheckpointError(
            f"the file holds a {kind}, which safe loading does not admit",
            where=str(path),
            fix="zerotron reads Megatron files with weights_only=True and admits only "
            f"{', '.join(ALLOWED_GLOBALS_DOC)}; re-save the weights with a tool you trust",
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise _corrupt(path, e) from None


def _corrupt(path: Path, e: Exception) -> CheckpointError:
    first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
    return CheckpointError(
        f"cannot read the file ({type(e).__name__}: {first})",
        where=str(path),
        fix="the file is truncated, corrupt or not a Megatron checkpoint file",
    )


# ---- finding the files -------------------------------------------------------------------------


def tag_dir(root: str | os.PathLike) -> Path:
    """The directory holding one checkpoint: ``root`` itself when it holds rank directories, a
    torch_dist save or DeepSpeed's model-states files (Megatron-DeepSpeed), else the tag
    DeepSpeed's ``latest`` names when that holds DeepSpeed's files, else the
    ``iter_XXXXXXX``/``release`` Megatron's tracker names."""
    root = Path(root)
    if not root.is_dir():
        raise CheckpointError(
            "no such directory" if not root.exists() else "not a directory",
            where=str(root),
            fix="point --from-megatron to a Megatron-LM --save directory",
        )
    if is_torch_dist(root) or rank_dirs(root) or (root / DEEPSPEED_MODEL_STATES).is_file():
        return root
    latest = root / DEEPSPEED_TRACKER
    if latest.is_file():
        name = latest.read_text(encoding="utf-8", errors="replace").strip()
        if name and "/" not in name and (root / name / DEEPSPEED_MODEL_STATES).is_file():
            return root / name
    tracker = root / TRACKER
    if not tracker.is_file():
        raise CheckpointError(
            f"neither {TRACKER} nor mp_rank_* / torch_dist files",
            where=str(root),
            fix="point --from-megatron to a Megatron-LM --save directory or one iter_* in it",
        )
    text = tracker.read_text(encoding="utf-8", errors="replace").strip()
    if text == "release":
        name = "release"
    elif text.isdigit():
        name = f"iter_{int(text):07d}"
    else:
        raise CheckpointError(f"tracker holds {text[:40]!r}", where=str(tracker))
    if not (root / name).is_dir():
        raise CheckpointError(f"the tracker names {name}, which is missing", where=str(root))
    return root / name


def is_torch_dist(path: Path) -> bool:
    meta = path / "metadata.json"
    if meta.is_file():
        try:
            backend = json.loads(meta.read_text(encoding="utf-8")).get("sharded_backend")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            return False
        return backend == "torch_dist"
    return (path / ".metadata").is_file()


def rank_dirs(path: Path) -> dict[tuple[int, int], Path]:
    """``{(tp_rank, pp_rank): file}`` of the ``mp_rank_*`` directories in ``path``."""
    found = {}
    for child in sorted(path.iterdir()):
        m = _RANK_DIR.fullmatch(child.name)
        if m and child.is_dir():
            found[(int(m.group(1)), int(m.group(2) or 0))] = child / MODEL_FILE
    return found


def read_rank_files(
    path: Path, tensor_rank: int | None = None, stages: Collection[int] | None = None
) -> tuple[dict[tuple[int, int], dict], int, int]:
    """Every rank's file of a per-rank checkpoint: ``({(t, p): loaded dict}, tp, pp)``; with
    ``tensor_rank`` and ``stages``, only the files of that tensor rank and those pipeline
    stages are read."""
    dirs = rank_dirs(path)
    tp = 1 + max(t for t, _ in dirs)
    pp = 1 + max(p for _, p in dirs)
    missing = [(t, p) for t in range(tp) for p in range(pp) if (t, p) not in dirs]
    if missing:
        raise CheckpointError(
            f"rank directories missing for (tensor, pipeline) ranks {missing} of {tp}x{pp}",
            where=str(path),
            fix="copy the whole checkpoint directory",
        )
    files = {}
    for key, file in dirs.items():
        if tensor_rank is not None and key[0] != tensor_rank:
            continue
        if stages is not None and key[1] not in stages:
            continue
        if not file.is_file():
            raise CheckpointError(f"{MODEL_FILE} is missing", where=str(file.parent))
        loaded = load_safe(file)
        if not isinstance(loaded, dict):
            raise CheckpointError(f"holds a {type(loaded).__name__}, not a dict", where=str(file))
        files[key] = loaded
    return files, tp, pp


# ---- torch_dist --------------------------------------------------------------------------------

# The classes a torch.distributed.checkpoint .metadata pickle may name (module, name).
_DCP_CLASSES = {
    ("torch.distributed.checkpoint.metadata", n)
    for n in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.planner", "SavePlan"),
    ("torch.distributed.checkpoint.planner", "WriteItem"),
    ("torch.distributed.checkpoint.planner", "WriteItemType"),
    ("torch.distributed.checkpoint.planner", "TensorWriteData"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    # StorageMeta.checkpoint_id: the directory it was saved to, a str or a path object.
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_CLASSES or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"GLOBAL {module}.{name} is not admitted")


def _safe_reader(path: Path):
    from torch.distributed.checkpoint import FileSystemReader

    class SafeReader(FileSystemReader):
        """torch's reader, with ``.metadata`` read by the allow-listed unpickler."""

        def read_metadata(self, *args: Any, **kwargs: Any):
            from torch.distributed.checkpoint.metadata import StorageMeta

            file = Path(self.path) / ".metadata"
            try:
                with open(file, "rb") as f:
                    metadata = _MetadataUnpickler(f).load()
            except pickle.UnpicklingError as e:
                raise CheckpointError(
                    f"the torch_dist metadata holds a type safe loading does not admit ({e})",
                    where=str(file),
                ) from None
            except (OSError, EOFError, ValueError, AttributeError, TypeError) as e:
                raise _corrupt(file, e) from None
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(path))


Region = tuple[tuple[int, ...], tuple[int, ...]]
"""A box of a global tensor: (offsets, sizes), one per dimension."""


def torch_dist_shapes(path: Path) -> dict[str, torch.Size]:
    """The global shape of every tensor of a ``torch_dist`` directory (its metadata alone)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = _safe_reader(path).read_metadata()
    return {
        key: torch.Size(meta.size)
        for key, meta in metadata.state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata)
    }


def read_torch_dist(
    path: Path, regions: Mapping[str, Region | None] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The global tensors of a ``torch_dist`` directory, and its ``common.pt`` entries.

    ``regions`` None: every tensor, whole. Else only its keys: a key's region (offsets, sizes)
    is read alone, into a tensor of those sizes (only the saved chunks it overlaps are read);
    None reads that tensor whole."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = _safe_reader(path)
    metadata = reader.read_metadata()
    stored = {
        key: meta
        for key, meta in metadata.state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata)
    }
    wanted = dict.fromkeys(stored) if regions is None else dict(regions)
    missing = sorted(set(wanted) - set(stored))
    if missing:
        raise CheckpointError(
            f"no tensor {missing[0]!r} in the torch_dist metadata", where=str(path)
        )
    boxes = {k: r or ((0,) * len(stored[k].size), tuple(stored[k].size)) for k, r in wanted.items()}
    for key, (offsets, sizes) in boxes.items():
        shape = tuple(stored[key].size)
        if len(offsets) != len(shape) or any(
            o < 0 or n < 0 or o + n > d for o, n, d in zip(offsets, sizes, shape)
        ):
            raise CheckpointError(
                f"the region {list(offsets)} + {list(sizes)} of {key!r} is not inside its "
                f"shape {list(shape)}",
                where=str(path),
            )
    tensors = {
        k: torch.empty(sizes, dtype=stored[k].properties.dtype) for k, (_, sizes) in boxes.items()
    }
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process"
            dcp.load(tensors, storage_reader=reader, planner=_region_planner(boxes), no_dist=True)
    except CheckpointError:
        raise
    except Exception as e:  # torch wraps reader errors in CheckpointException
        raise _corrupt(path, e) from None
    common = load_safe(path / COMMON_FILE) if (path / COMMON_FILE).is_file() else {}
    return tensors, common if isinstance(common, dict) else {}


def _region_planner(boxes: Mapping[str, Region]) -> Any:
    """A load planner reading ``boxes`` (torch's checkpoint modules load on first use, as the
    rest of this module's torch_dist code does)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class RegionPlanner(DefaultLoadPlanner):
        """torch's load planner reading one box of each global tensor into a tensor of the
        box's size (torch's own reads whole tensors into plain tensors)."""

        def __init__(self, boxes: Mapping[str, Region]) -> None:
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
            self.boxes = boxes

        def create_local_plan(self) -> LoadPlan:
            items = []
            for key, (offsets, sizes) in self.boxes.items():
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
                md = self.metadata.state_dict_metadata[key]
                items += create_read_items_for_chunk_list(key, md, [chunk])
            return LoadPlan(items)

        def lookup_tensor(self, index: Any) -> torch.Tensor:
            return self.state_dict[index.fqn]  # the box itself: offsets are relative to it

    return RegionPlanner(boxes)


def write_torch_dist(
    path: str | os.PathLike,
    tensors: Mapping[str, torch.Tensor],
    objects: Mapping[str, Any],
    common: Mapping[str, Any],
) -> None:
    """Write a ``torch_dist`` directory as megatron-core's ``dist_checkpointing.save`` does:
    the tensors (global, one chunk each) and ``objects`` (pickled with ``torch.save``, as its
    ``ShardedObject`` entries) through torch.distributed.checkpoint, ``common.pt`` and
    megatron's ``metadata.json``; atomically (a temporary directory renamed into place)."""
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    with atomic_dir(path) as tmp:
        # torch's save planner pickles non-tensor values itself (torch.save into the file).
        state: dict[str, Any] = {k: v.contiguous() for k, v in tensors.items()}
        state.update(objects)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process"
            dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), no_dist=True)
        torch.save(dict(common), Path(tmp) / COMMON_FILE)
        backend = {
            "sharded_backend": "torch_dist",
            "sharded_backend_version": 1,
            "common_backend": "torch",
            "common_backend_version": 1,
        }
        (Path(tmp) / "metadata.json").write_text(json.dumps(backend))
        commit_dir(tmp, path)


def write_rank_files(path: str | os.PathLike, files: Iterable[tuple[str, dict]]) -> None:
    """Write ``(rank directory name, dict)`` pairs as ``path/<name>/model_optim_rng.pt``,
    atomically (a temporary directory renamed into place once every file is written)."""
    with atomic_dir(path) as tmp:
        for name, obj in files:
            file = Path(tmp) / name / MODEL_FILE
            file.parent.mkdir(parents=True, exist_ok=True)
            torch.save(obj, file)
        commit_dir(tmp, path)


def tag_name(iteration: int | None) -> str:
    """The directory Megatron-LM keeps an iteration in (``release`` for none)."""
    return f"iter_{iteration:07d}" if iteration else "release"


def write_tracker(root: str | os.PathLike, iteration: int | None) -> None:
    """Point ``latest_checkpointed_iteration.txt`` at ``iteration`` (after its files exist)."""
    atomic_write_text(Path(root) / TRACKER, str(iteration) if iteration else "release")
