"""Write a ``.pt`` file tensor by tensor, so that saving needs one tensor in memory at a time.

``torch.save`` pickles a whole object tree whose tensors all exist. A converted checkpoint file
is described before its tensors exist: a tree whose tensor leaves are :class:`Pending` (shape,
dtype and a function that produces the tensor). :func:`save_streaming` produces them one at a
time, writes each one's storage record into the zip archive at once and drops it, and writes the
pickle (which only refers to the records by key) last. The result is an ordinary torch file:
``torch.load(weights_only=True)`` reads it (also with ``mmap=True``: records are aligned as
torch aligns them). :func:`materialize` produces the same tree in memory instead, for a caller
that loads it at once (an Engine resuming on another layout).
"""

from __future__ import annotations

import collections
import io
import pickle
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import torch

from zerotron.errors import CheckpointError

PICKLE_PROTOCOL = 2  # torch.save's default
STORAGE_ALIGNMENT = 64  # torch's zip writer aligns every record's data to this


class Pending:
    """A tensor leaf not produced yet: ``produce()`` returns a tensor of ``shape`` and ``dtype``."""

    __slots__ = ("dtype", "produce", "shape")

    def __init__(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype, produce: Callable):
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.produce = produce

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * torch.empty((), dtype=self.dtype).element_size()

    def make(self, where: str = "") -> torch.Tensor:
        """The tensor, checked against the promised shape and dtype."""
        t = self.produce()
        if not isinstance(t, torch.Tensor) or t.shape != self.shape or t.dtype != self.dtype:
            got = f"{list(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t)
            raise CheckpointError(
                f"a produced tensor is {got}, expected {list(self.shape)} {self.dtype}",
                where=where or None,
            )
        return t

    def __repr__(self) -> str:
        return f"Pending({list(self.shape)}, {self.dtype})"


def _walk(tree: Any) -> Iterator[Any]:
    """Every leaf of ``tree`` (dicts, lists, tuples), depth first in insertion order."""
    stack = [tree]
    while stack:
        value = stack.pop()
        if isinstance(value, Mapping):
            stack.extend(reversed(list(value.values())))
        elif isinstance(value, (list, tuple)):
            stack.extend(reversed(value))
        else:
            yield value


def pending_leaves(tree: Any) -> list[Pending]:
    """The :class:`Pending` leaves of ``tree`` in the order they are produced (each once)."""
    seen: set[int] = set()
    out = []
    for leaf in _walk(tree):
        if isinstance(leaf, Pending) and id(leaf) not in seen:
            seen.add(id(leaf))
            out.append(leaf)
    return out


def _map(tree: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(tree, collections.OrderedDict):
        return collections.OrderedDict((k, _map(v, fn)) for k, v in tree.items())
    if isinstance(tree, Mapping):
        return {k: _map(v, fn) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_map(v, fn) for v in tree]
    if isinstance(tree, tuple):
        return tuple(_map(v, fn) for v in tree)
    return fn(tree)


def materialize(tree: Any, where: str = "") -> Any:
    """``tree`` with every :class:`Pending` replaced by its tensor (produced once each)."""
    made: dict[int, torch.Tensor] = {}

    def fn(leaf: Any) -> Any:
        if isinstance(leaf, Pending):
            if id(leaf) not in made:
                made[id(leaf)] = leaf.make(where)
            return made[id(leaf)]
        return leaf

    return _map(tree, fn)


class _StorageRef:
    """What the pickle holds in a storage's place: its record key (see ``persistent_id``)."""

    __slots__ = ("dtype", "key", "numel")

    def __init__(self, key: str, dtype: torch.dtype, numel: int):
        self.key, self.dtype, self.numel = key, dtype, numel


def _storage_type(dtype: torch.dtype) -> Any:
    return getattr(torch, torch.storage._dtype_to_storage_type_map()[dtype])


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= max(int(d), 1)
    return tuple(reversed(stride))


class _Pickler(pickle.Pickler):
    def __init__(self, f: IO[bytes], refs: dict[int, _StorageRef]):
        super().__init__(f, protocol=PICKLE_PROTOCOL)
        self.refs = refs

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageRef):
            return ("storage", _storage_type(obj.dtype), obj.key, "cpu", obj.numel)
        return None

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, Pending):
            ref = self.refs[id(obj)]
            args = (
                ref,
                0,
                obj.shape,
                _contiguous_stride(obj.shape),
                False,
                collections.OrderedDict(),
            )
            return (torch._utils._rebuild_tensor_v2, args)
        return NotImplemented


def save_streaming(
    tree: Any,
    path: str | Path | IO[bytes],
    *,
    on_tensor: Callable[[torch.Tensor], None] | None = None,
) -> int:
    """Write ``tree`` (tensors or :class:`Pending` leaves) as a torch file; return tensor bytes.

    Each tensor is produced, written as its own storage record and released before the next
    one is produced; ``on_tensor(t)`` (e.g. a memory probe) sees each while it is alive. A tensor
    that shares storage with another is written on its own (the file stores it once per leaf).
    """
    # Real tensors become Pending too, so one path writes every record.
    tree = _map(tree, lambda v: _wrap(v) if isinstance(v, torch.Tensor) else v)
    leaves = pending_leaves(tree)
    refs: dict[int, _StorageRef] = {}
    total = 0
    if isinstance(path, Path):
        path = str(path)  # torch's zip writer takes a str or a file object
    with torch.serialization._open_zipfile_writer(path) as zf:
        for k, leaf in enumerate(leaves):
            t = leaf.make().detach().cpu()
            if (
                not t.is_contiguous()
                or t.storage_offset()
                or (t.untyped_storage().nbytes() != t.numel() * t.element_size())
            ):
                t = t.contiguous().clone()  # the record holds exactly this tensor's elements
            nbytes = t.numel() * t.element_size()
            if on_tensor is not None:
                on_tensor(t)
            zf.write_record(f"data/{k}", t.untyped_storage(), nbytes)
            refs[id(leaf)] = _StorageRef(str(k), leaf.dtype, t.numel())
            total += nbytes
            del t
        buf = io.BytesIO()
        _Pickler(buf, refs).dump(tree)
        data = buf.getvalue()
        zf.write_record("data.pkl", data, len(data))
        zf.write_record(".format_version", "1", 1)
        align = str(STORAGE_ALIGNMENT)
        zf.write_record(".storage_alignment", align, len(align))
        zf.write_record("byteorder", sys.byteorder, len(sys.byteorder))
    return total


def _wrap(t: torch.Tensor) -> Pending:
    return Pending(t.shape, t.dtype, lambda: t)
