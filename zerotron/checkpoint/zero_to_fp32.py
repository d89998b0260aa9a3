"""``zerotron zero-to-fp32``: consolidate a ZeRO checkpoint's fp32 weights offline.

Under ZeRO every data-parallel rank saves only its partition of the fp32 master weights, in
``zero_dp_rank_{dp}_mp_rank_{tp:02d}_{pp:03d}_optim_states.pt``, with a ``layout`` saying where
each parameter's piece lies (see ``zerotron/zero/optimizer.py``)::

    {"name", "shape", "numel", "chunk", "start", "length", "partition", "offset"}

meaning: elements ``[start, start + length)`` of the flattened parameter ``name`` are elements
``[offset, offset + length)`` of this rank's ``fp32_partitions[partition]``. The N files of one
model-parallel rank cover every element of every parameter exactly once; this module checks that
and puts the pieces back together, without processes or a model.

Memory. The files are opened with ``torch.load(weights_only=True, mmap=True)``: nothing is read
until touched, and the optimizer's moments (2× the weights for Adam) are never touched. For the
safetensors output the pieces are written file by file straight to their byte offsets in the output
(its header is known from the layout before any data is read), so the process holds about one rank's
partitions at a time, not the model. The Megatron output builds each model-parallel rank's state
dict in memory (1× its size) because ``torch.save`` needs it whole.

Outputs (``--format``):

- ``safetensors`` (default): one ``.safetensors`` file of fp32 tensors named as in
  ``model.state_dict()``; buffers and frozen parameters (not in the optimizer) are copied from the
  model file as saved. A tensor shared under two names (tied weights) is stored once; its other
  names are listed in the header's ``__metadata__["shared"]`` (JSON ``{alias: name}``). With
  more than one model-parallel rank, OUT is a directory with one file per rank
  (``mp_rank_00_000.safetensors``, ...), as the checkpoint has one model file per rank.
- ``megatron``: OUT becomes a checkpoint directory with tag ``release`` (fp32 model files, no
  optimizer, metadata.json copied with zero stage 0 and params dtype fp32), so
  ``zerotron generate --load OUT`` and ``zerotron convert --load OUT --to-hf DIR`` read it.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from zerotron.checkpoint import layout
from zerotron.checkpoint.save_load import load_file, read_metadata, resolve_tag, save_checkpoint
from zerotron.errors import CheckpointError, ConfigError
from zerotron.fileio import check_free_space, commit, disk_full_is_clear, temp_path
from zerotron.progress import Progress

ZERO_FILE = re.compile(r"zero_dp_rank_(\d+)_mp_rank_(\d{2})_(\d{3})_optim_states\.pt")
SHARED_PARAMS_KEY = "shared_params"
"""Model-file entry ``{alias: name}`` for state-dict keys that are another parameter (tied)."""
BUFFER_NAMES_KEY = "buffer_names"
"""Model-file entry: the module's buffer names (DeepSpeed's key), which tell the saved buffers
from frozen parameters (neither is in the ZeRO files)."""

_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


# ---------------------------------------------------------------------------------------------
# Finding the files


def find_checkpoint(path: str | os.PathLike, tag: str | None = None) -> tuple[Path, str]:
    """``(root, tag)`` for a save directory (tag from ``latest`` if None) or a tag directory."""
    path = Path(path)
    if tag is None and (path / layout.METADATA_FILE).is_file():
        return path.parent, path.name
    return path, resolve_tag(path, tag)


def zero_files_by_mp_rank(tag_dir: Path) -> dict[tuple[int, int], list[str]]:
    """``{(tp_rank, pp_rank): [zero file of dp rank 0, 1, ...]}``, checked to be complete."""
    found: dict[tuple[int, int], dict[int, str]] = {}
    for name in sorted(os.listdir(tag_dir)):
        m = ZERO_FILE.fullmatch(name)
        if m:
            dp, tp, pp = map(int, m.groups())
            found.setdefault((tp, pp), {})[dp] = name
    if not found:
        raise CheckpointError(
            "no ZeRO partition files (zero_dp_rank_*_optim_states.pt) in this checkpoint",
            where=str(tag_dir),
            fix="zero-to-fp32 reads checkpoints saved with ZeRO stage >= 1; a stage-0 checkpoint "
            "already holds whole weights in its mp_rank_* model files",
        )
    sizes = {len(ranks) for ranks in found.values()}
    out = {}
    for key, ranks in sorted(found.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        n = max(sizes)
        missing = [d for d in range(n) if d not in ranks]
        if missing:
            raise CheckpointError(
                f"ZeRO files of data-parallel ranks {missing} are missing for model-parallel "
                f"rank tp={key[0]} pp={key[1]} ({len(ranks)} of {n} present)",
                where=str(tag_dir),
                fix="copy the complete checkpoint directory (every rank wrote one file)",
            )
        out[key] = [ranks[d] for d in range(n)]
    return out


def _load(tag_dir: Path, name: str) -> Any:
    """A checkpoint file, memory-mapped: tensors are read from disk only when touched."""
    path = tag_dir / name
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - load_file gives the precise error (corrupt, unsafe, ...)
        return load_file(tag_dir.parent, tag_dir.name, name)


# ---------------------------------------------------------------------------------------------
# The plan: where every element of every parameter is


@dataclass
class Piece:
    """Elements ``[start, start+length)`` of a parameter = ``fp32_partitions[partition]
    [offset : offset+length]`` of data-parallel rank ``rank``'s file."""

    rank: int
    partition: int
    offset: int
    start: int
    length: int


@dataclass
class ParamPlan:
    name: str
    shape: tuple[int, ...]
    numel: int
    pieces: list[Piece] = field(default_factory=list)


def _entry(e: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in e:
        raise CheckpointError(
            f"a layout entry has no {key!r}: {dict(e)}",
            where=where,
            fix="this file was not written by zerotron's ZeroOptimizer.state_dict()",
        )
    return e[key]


def plan_parameters(
    states: Iterable[Mapping[str, Any]], where: str, partition_sizes: list[list[int]] | None = None
) -> list[ParamPlan]:
    """Check the layouts of one model-parallel rank's N zero states; where each element is.

    ``states[r]`` is data-parallel rank r's state (at least ``layout`` and ``dp_size``). Every
    parameter must be covered exactly once by the pieces; ``partition_sizes[r][p]`` (if given)
    bounds each piece inside its partition.
    """
    plans: dict[str, ParamPlan] = {}
    states = list(states)
    n = len(states)
    for r, st in enumerate(states):
        file_where = f"{where} (data-parallel rank {r})"
        if "layout" not in st:
            raise CheckpointError(
                "the ZeRO file has no 'layout'", where=file_where, fix="re-save with zerotron"
            )
        dp_size = st.get("dp_size", n)
        if dp_size != n or st.get("dp_rank", r) != r:
            raise CheckpointError(
                f"file says dp_rank {st.get('dp_rank')} of {dp_size}; expected rank {r} of {n}",
                where=file_where,
                fix="the directory mixes files of different saves: copy one save completely",
            )
        for e in st["layout"]:
            name = _entry(e, "name", file_where)
            shape = tuple(int(s) for s in _entry(e, "shape", file_where))
            numel = int(e.get("numel", _numel(shape)))
            plan = plans.setdefault(name, ParamPlan(name, shape, numel))
            if plan.shape != shape or plan.numel != numel or _numel(shape) != numel:
                raise CheckpointError(
                    f"parameter {name!r} has shape {list(shape)} ({numel} elements) here, "
                    f"{list(plan.shape)} ({plan.numel}) in another rank's file",
                    where=file_where,
                    fix="the directory mixes files of different saves",
                )
            piece = Piece(
                r,
                int(_entry(e, "partition", file_where)),
                int(_entry(e, "offset", file_where)),
                int(_entry(e, "start", file_where)),
                int(_entry(e, "length", file_where)),
            )
            if partition_sizes is not None:
                sizes = partition_sizes[r]
                if not (
                    0 <= piece.partition < len(sizes)
                    and piece.offset >= 0
                    and piece.offset + piece.length <= sizes[piece.partition]
                ):
                    raise CheckpointError(
                        f"the piece of {name!r} (partition {piece.partition}, offset "
                        f"{piece.offset}, length {piece.length}) lies outside the saved fp32 "
                        f"partitions {sizes}",
                        where=file_where,
                        fix="the file is corrupt or from another version",
                    )
            if piece.length > 0:
                plan.pieces.append(piece)
    for plan in plans.values():
        _check_coverage(plan, where)
    return list(plans.values())


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _check_coverage(plan: ParamPlan, where: str) -> None:
    end = 0
    for piece in sorted(plan.pieces, key=lambda p: p.start):
        if piece.start != end:
            what = "overlap" if piece.start < end else "a gap"
            raise CheckpointError(
                f"the pieces of {plan.name!r} leave {what} at element {min(end, piece.start)} "
                f"of {plan.numel}",
                where=where,
                fix="the directory mixes files of different saves, or one is corrupt",
            )
        end = piece.start + piece.length
    if end != plan.numel:
        raise CheckpointError(
            f"the pieces of {plan.name!r} cover {end} of its {plan.numel} elements",
            where=where,
            fix="a ZeRO file is missing or from another save",
        )


def _partition_sizes(state: Mapping[str, Any], where: str) -> list[int]:
    parts = state.get("fp32_partitions")
    if not isinstance(parts, (list, tuple)) or not all(isinstance(p, torch.Tensor) for p in parts):
        raise CheckpointError(
            "the ZeRO file has no 'fp32_partitions' list of tensors",
            where=where,
            fix="re-save with zerotron's ZeroOptimizer",
        )
    return [p.numel() for p in parts]


# ---------------------------------------------------------------------------------------------
# One model-parallel rank


@dataclass
class MpRank:
    """What one model-parallel rank's output holds, in order, and where its data comes from."""

    tp: int
    pp: int
    files: list[str]
    plans: list[ParamPlan]
    extras: dict[str, torch.Tensor]  # buffers / frozen params, from the model file (mmap)
    order: list[str]  # output names in state-dict order (aliases excluded)
    shared: dict[str, str]  # alias -> stored name
    keys: list[str]  # every name in state-dict order, aliases included
    buffers: set[str] | None = None  # buffer names, if the model file lists them


def _model_state(tag_dir: Path, tp: int, pp: int, pp_size: int) -> dict[str, Any]:
    rel = layout.model_file(tp, pp, pp_size)
    if not (tag_dir / rel).is_file():
        return {}
    state = _load(tag_dir, rel)
    return state if isinstance(state, dict) else {}


def _mp_rank(tag_dir: Path, tp: int, pp: int, pp_size: int, files: list[str]) -> MpRank:
    where = f"{tag_dir} (mp rank tp={tp} pp={pp})"
    states, sizes = [], []
    for name in files:
        st = _load(tag_dir, name)
        sizes.append(_partition_sizes(st, str(tag_dir / name)))
        # keep only the small parts: the mapped partitions are re-opened when written
        states.append({k: st.get(k) for k in ("layout", "dp_size", "dp_rank")})
        del st
    plans = plan_parameters(states, where, sizes)
    by_name = {p.name: p for p in plans}
    model_state = _model_state(tag_dir, tp, pp, pp_size)
    module = model_state.get("model") or {}
    shared = dict(model_state.get(SHARED_PARAMS_KEY) or {})
    order: list[str] = []
    keys: list[str] = []
    extras: dict[str, torch.Tensor] = {}
    for key, value in module.items():
        if not isinstance(value, torch.Tensor):
            continue
        keys.append(key)
        if key in shared:
            continue
        order.append(key)
        if key not in by_name:
            extras[key] = value
    in_order = set(order)
    order += [p.name for p in plans if p.name not in in_order]
    for alias, name in list(shared.items()):
        if name not in by_name and name not in extras:
            del shared[alias]
    stored = set(order)
    keys = [k for k in keys if k in shared or k in stored]
    listed = set(keys)
    keys += [n for n in order if n not in listed]
    names = model_state.get(BUFFER_NAMES_KEY)
    buffers = set(names) if isinstance(names, (list, tuple)) else None
    return MpRank(tp, pp, files, plans, extras, order, shared, keys, buffers)


def _mp_ranks(tag_dir: Path) -> list[MpRank]:
    groups = zero_files_by_mp_rank(tag_dir)
    pp_size = max(pp for _, pp in groups) + 1
    meta_pp = _metadata(tag_dir).get("layout", {}).get("pipeline_model_parallel_size")
    pp_size = int(meta_pp or pp_size)
    return [_mp_rank(tag_dir, tp, pp, pp_size, files) for (tp, pp), files in groups.items()]


def _metadata(tag_dir: Path) -> dict[str, Any]:
    try:
        return read_metadata(tag_dir.parent, tag_dir.name)
    except CheckpointError:
        return {}


def _fill(
    tag_dir: Path,
    rank: MpRank,
    write: Any,
    only: set[str] | None = None,
    progress: Progress | None = None,
) -> None:
    """Call ``write(name, start, fp32 piece)`` for every piece (of the parameters in
    ``only``, if given), one zero file at a time; ``progress`` counts the files."""
    by_rank: dict[int, list[tuple[ParamPlan, Piece]]] = {}
    for plan in rank.plans:
        if only is not None and plan.name not in only:
            continue
        for piece in plan.pieces:
            by_rank.setdefault(piece.rank, []).append((plan, piece))
    for r, name in enumerate(rank.files):
        if r in by_rank:
            parts = _load(tag_dir, name)["fp32_partitions"]
            for plan, piece in by_rank[r]:
                src = parts[piece.partition].reshape(-1)[piece.offset : piece.offset + piece.length]
                write(plan.name, piece.start, src.to(torch.float32))
            del parts  # unmaps this rank's file before the next is touched
        if progress is not None:
            progress.update(1, info=name)


# ---------------------------------------------------------------------------------------------
# In memory


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str | os.PathLike, tag: str | None = None, *, tp_rank: int = 0, pp_rank: int = 0
) -> dict[str, torch.Tensor]:
    """The consolidated fp32 state dict of one model-parallel rank (DeepSpeed's function name).

    Tied parameters appear under each of their names as the same tensor, as in
    ``model.state_dict()``.
    """
    root, tag = find_checkpoint(checkpoint_dir, tag)
    tag_dir = layout.tag_dir(root, tag)
    ranks = {(r.tp, r.pp): r for r in _mp_ranks(tag_dir)}
    if (tp_rank, pp_rank) not in ranks:
        raise ConfigError(
            f"no ZeRO files for model-parallel rank tp={tp_rank} pp={pp_rank}",
            where=str(tag_dir),
            fix=f"choose one of {sorted(ranks)}",
        )
    return _state_dict(tag_dir, ranks[(tp_rank, pp_rank)])


def _state_dict(
    tag_dir: Path, rank: MpRank, only: set[str] | None = None, progress: Progress | None = None
) -> dict[str, torch.Tensor]:
    """The state dict of one model-parallel rank; with ``only``, of those names (aliases
    of tied parameters included when their parameter is)."""
    keys = [k for k in rank.keys if only is None or rank.shared.get(k, k) in only]
    wanted = {rank.shared.get(k, k) for k in keys}
    flat = {p.name: torch.empty(p.numel, dtype=torch.float32) for p in rank.plans}
    flat = {name: t for name, t in flat.items() if name in wanted}

    def write(name: str, start: int, piece: torch.Tensor) -> None:
        flat[name][start : start + piece.numel()].copy_(piece)

    _fill(tag_dir, rank, write, wanted, progress)
    shapes = {p.name: p.shape for p in rank.plans}
    own = {
        name: flat[name].view(shapes[name]) if name in flat else rank.extras[name].clone()
        for name in rank.order
        if name in wanted
    }
    return {key: own[rank.shared.get(key, key)] for key in keys}


# ---------------------------------------------------------------------------------------------
# safetensors, streamed


class SafetensorsWriter:
    """Writes a ``.safetensors`` file whose tensors arrive in pieces, in any order.

    The header (names, dtypes, shapes, byte ranges) is written first, the file extended to its
    full size, and each piece goes straight to its place with ``pwrite``; the file appears
    under its name (atomically) only when :meth:`close` is called with every byte written.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        tensors: list[tuple[str, torch.dtype, tuple[int, ...]]],
        metadata: Mapping[str, str] | None = None,
    ):
        self.path = Path(path)
        header: dict[str, Any] = {}
        if metadata:
            header["__metadata__"] = dict(metadata)
        self._where: dict[str, tuple[int, int, int]] = {}  # name -> (data start, nbytes, itemsize)
        pos = 0
        for name, dtype, shape in tensors:
            itemsize = torch.empty((), dtype=dtype).element_size()
            nbytes = _numel(shape) * itemsize
            header[name] = {
                "dtype": _SAFETENSORS_DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [pos, pos + nbytes],
            }
            self._where[name] = (pos, nbytes, itemsize)
            pos += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes
        self._base = 8 + len(raw)
        self._size = self._base + pos
        self._written = 0
        self._tmp = temp_path(self.path)
        self._fd = -1
        self.path.parent.mkdir(parents=True, exist_ok=True)
        check_free_space(self.path.parent, self._size, f"{self.path.name}")
        with disk_full_is_clear(self.path):
            self._fd = os.open(self._tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.pwrite(self._fd, struct.pack("<Q", len(raw)) + raw, 0)
                os.ftruncate(self._fd, self._size)
            except BaseException:
                self.abort()
                raise

    def write(self, name: str, start: int, values: torch.Tensor) -> None:
        """Elements ``[start, start + values.numel())`` of tensor ``name``."""
        pos, nbytes, itemsize = self._where[name]
        data = values.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        lo = start * itemsize
        if lo < 0 or lo + data.nbytes > nbytes:
            raise ValueError(f"{name}: elements beyond its size")
        view = memoryview(data)
        with disk_full_is_clear(self.path):
            done = 0
            while done < len(view):
                done += os.pwrite(self._fd, view[done:], self._base + pos + lo + done)
        self._written += data.nbytes

    def close(self) -> Path:
        """fsync, check every byte arrived, rename into place."""
        try:
            if self._written != self._size - self._base:
                raise CheckpointError(
                    f"wrote {self._written} of {self._size - self._base} data bytes",
                    where=str(self.path),
                    fix="a bug: some tensor was not written completely",
                )
            os.close(self._fd)
            self._fd = -1
            with disk_full_is_clear(self.path):
                commit(self._tmp, self.path)
        except BaseException:
            self.abort()
            raise
        return self.path

    def abort(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._tmp.unlink(missing_ok=True)


def _write_safetensors(
    tag_dir: Path,
    rank: MpRank,
    path: Path,
    meta: Mapping[str, str],
    only: set[str] | None = None,
    progress: Progress | None = None,
) -> Path:
    """One ``.safetensors`` file of the rank's tensors (those in ``only``, if given)."""
    plans = {p.name: p for p in rank.plans}
    names = [n for n in rank.order if only is None or n in only]
    shared = {a: n for a, n in rank.shared.items() if n in names}
    tensors = []
    for name in names:
        if name in plans:
            tensors.append((name, torch.float32, plans[name].shape))
        else:
            t = rank.extras[name]
            if t.dtype not in _SAFETENSORS_DTYPES:
                raise CheckpointError(
                    f"tensor {name!r} has dtype {t.dtype}, which safetensors cannot hold",
                    where=str(tag_dir),
                    fix="use --format megatron",
                )
            tensors.append((name, t.dtype, tuple(t.shape)))
    metadata = {"format": "pt", **meta}
    if shared:
        metadata["shared"] = json.dumps(shared)
    writer = SafetensorsWriter(path, tensors, metadata)
    try:
        _fill(tag_dir, rank, writer.write, set(names), progress)
        for name, t in rank.extras.items():
            if name in names:
                writer.write(name, 0, t)
    except BaseException:
        writer.abort()
        raise
    return writer.close()


# ---------------------------------------------------------------------------------------------
# The command


def zero_to_fp32(
    checkpoint_dir: str | os.PathLike,
    out: str | os.PathLike,
    tag: str | None = None,
    *,
    format: str = "safetensors",
    progress: bool = False,
) -> list[Path]:
    """Consolidate the fp32 weights of a ZeRO checkpoint into ``out``; the files written.

    See the module docstring for the two formats. ``progress`` reports the ZeRO files read on
    stderr (:mod:`zerotron.progress`: a bar on a terminal, else a line every 10 s).
    """
    root, tag = find_checkpoint(checkpoint_dir, tag)
    tag_dir = layout.tag_dir(root, tag)
    ranks = _mp_ranks(tag_dir)
    out = Path(out)
    if format not in ("safetensors", "megatron"):
        raise ConfigError(
            f"unknown format {format!r}", where="--format", fix="use safetensors or megatron"
        )
    total = sum(len(r.files) for r in ranks)
    with Progress("zero-to-fp32", total, unit="files", enabled=progress) as bar:
        if format == "megatron":
            return [_write_megatron(tag_dir, ranks, out, bar)]
        source = {"source": str(tag_dir)}
        if len(ranks) == 1:
            return [_write_safetensors(tag_dir, ranks[0], out, source, progress=bar)]
        pp_size = max(r.pp for r in ranks) + 1
        return [
            _write_safetensors(
                tag_dir,
                r,
                out / f"{layout.model_dir(r.tp, r.pp, pp_size)}.safetensors",
                source,
                progress=bar,
            )
            for r in ranks
        ]


def _write_megatron(tag_dir: Path, ranks: list[MpRank], out: Path, progress: Progress) -> Path:
    meta = _metadata(tag_dir)
    for key in ("tag", "iteration", "files", "versions", "saved_at", "format_version"):
        meta.pop(key, None)
    lay = meta.setdefault("layout", {})
    pp_size = int(lay.get("pipeline_model_parallel_size") or max(r.pp for r in ranks) + 1)
    lay.update(data_parallel_size=1, zero_stage=0)
    meta["params_dtype"] = "fp32"
    meta["source"] = str(tag_dir)
    files = {
        layout.model_file(r.tp, r.pp, pp_size): {
            "model": _state_dict(tag_dir, r, progress=progress),
            "checkpoint_version": layout.CHECKPOINT_VERSION,
        }
        for r in ranks
    }
    return save_checkpoint(out, layout.RELEASE_TAG, files, meta)


def build_parser() -> Any:
    from zerotron.config.args import ArgumentParser

    p = ArgumentParser(
        prog="zerotron zero-to-fp32",
        description="consolidate the fp32 weights of a ZeRO checkpoint (offline, streaming)",
    )
    p.add_argument("checkpoint_dir", metavar="CKPT_DIR", help="save directory (or a tag in it)")
    p.add_argument("out", metavar="OUT", help="output .safetensors file (or directory)")
    p.add_argument("--tag", help="checkpoint tag (default: the 'latest' file's)")
    p.add_argument(
        "--format",
        choices=("safetensors", "megatron"),
        default="safetensors",
        help="safetensors file(s), or a checkpoint directory (tag 'release') that "
        "zerotron generate / convert load",
    )
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    paths = zero_to_fp32(args.checkpoint_dir, args.out, args.tag, format=args.format, progress=True)
    for path in paths:
        print(f"wrote {path}")
    return 0
