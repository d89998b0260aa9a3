"""How ZeRO splits tensors over the N data-parallel ranks, and the bucket layout collectives use.

One rule for every stage and every helper (optimizer, stage 3, checkpoints, zero-to-fp32):

- **Chunks.** A tensor of ``n`` elements is split, on its flattened view, into N chunks of
  ``chunk = ceil(n / N)`` elements; rank r owns ``flat[r*chunk : (r+1)*chunk]``. The last chunks
  run past ``n`` and are zero-padded (``length`` of rank r's chunk may be < ``chunk``, even 0).
  Splitting each parameter on its own, rather than one flat buffer of all parameters, keeps a
  parameter's owner independent of its neighbours: stage 3 can gather one parameter, and a
  checkpoint can be read back one parameter at a time.
- **Rank-major buckets.** Collectives move many parameters at once. A bucket buffer is a
  ``[N, row_len]`` tensor whose row r is the concatenation, over the bucket's parameters, of
  their chunk r. So one ``reduce_scatter`` of the flattened buffer hands rank r exactly its row
  (its chunks of every parameter in the bucket), and one ``all_gather`` of rows rebuilds the
  buffer from which every full parameter is read back.

Everything here is pure tensor bookkeeping: no process groups, so it is tested by simulating N
ranks in one process.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from zerotron.errors import ConfigError
from zerotron.parallel.buckets import group_into_buckets


def chunk_size(numel: int, world: int) -> int:
    """Elements per rank for a tensor of ``numel`` elements split over ``world`` ranks."""
    if world <= 0:
        raise ConfigError(f"cannot split over {world} ranks", where="zero.partition")
    return -(-numel // world)


def chunk_bounds(numel: int, world: int, rank: int) -> tuple[int, int]:
    """``(start, length)`` of rank ``rank``'s chunk in the flattened tensor.

    ``length`` counts the real elements (``chunk`` minus the padding), so it may be 0.
    """
    chunk = chunk_size(numel, world)
    start = rank * chunk
    return start, max(0, min(chunk, numel - start))


def full_shape(p: Tensor) -> torch.Size:
    """A parameter's full shape, also while stage 3 holds it partitioned (``p.ds_shape``)."""
    shape = getattr(p, "ds_shape", None)
    return torch.Size(shape) if shape is not None else p.shape


def padded_view(flat: Tensor, world: int) -> Tensor:
    """``flat`` (1-D) as ``[world, chunk]``, zero-padded at the end (a copy only if padded)."""
    chunk = chunk_size(flat.numel(), world)
    pad = world * chunk - flat.numel()
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(world, chunk)


def shard(t: Tensor, world: int, rank: int) -> Tensor:
    """A new 1-D tensor: rank ``rank``'s chunk of ``t`` (zero-padded to ``chunk`` elements)."""
    start, length = chunk_bounds(t.numel(), world, rank)
    out = t.new_zeros(chunk_size(t.numel(), world))
    out[:length] = t.detach().reshape(-1)[start : start + length]
    return out


def unshard(chunks: Sequence[Tensor], shape: Sequence[int] | torch.Size) -> Tensor:
    """The full tensor of ``shape`` from every rank's chunk (in rank order), padding dropped."""
    numel = 1
    for d in shape:
        numel *= int(d)
    return torch.cat([c.reshape(-1) for c in chunks])[:numel].view(*shape)


@dataclass(frozen=True)
class Slot:
    """One tensor in a bucket: its shape, its chunk size and where its chunk sits in a row."""

    index: int
    """Position of the tensor in the list the bucket was built from."""
    shape: torch.Size
    numel: int
    chunk: int
    row_offset: int
    """Element offset of this tensor's chunk inside every row of the bucket."""


class BucketLayout:
    """The rank-major layout of some tensors: ``[world, row_len]``, row r = their chunks r.

    Built from shapes only; the same layout packs gradients for a reduce-scatter and
    parameters for an all-gather.
    """

    def __init__(self, shapes: Sequence[torch.Size], world: int, indices: Sequence[int]):
        self.world = world
        slots = []
        offset = 0
        for index, shape in zip(indices, shapes):
            shape = torch.Size(shape)
            numel = shape.numel()
            chunk = chunk_size(numel, world)
            slots.append(Slot(index, shape, numel, chunk, offset))
            offset += chunk
        self.slots: list[Slot] = slots
        self.row_len = offset

    @property
    def numel(self) -> int:
        """Elements of the ``[world, row_len]`` buffer (the tensors plus their padding)."""
        return self.world * self.row_len

    @property
    def indices(self) -> list[int]:
        return [s.index for s in self.slots]

    def pack(
        self,
        tensors: Sequence[Tensor | None],
        dtype: torch.dtype | None = None,
        *,
        consume: bool = False,
    ) -> Tensor:
        """A new ``[world, row_len]`` buffer holding ``tensors`` (one per slot; None = zeros).

        ``dtype`` defaults to the first tensor's; values are cast as they are copied in.
        ``consume=True`` (``tensors`` a list): each entry is set to None once copied, so a
        tensor nothing else holds is freed at once and the buffer does not double the memory.
        """
        first = next((t for t in tensors if t is not None), None)
        if dtype is None:
            dtype = first.dtype if first is not None else torch.float32
        device = first.device if first is not None else torch.device("cpu")
        del first
        _check(len(tensors) == len(self.slots), f"{len(tensors)} tensors, {len(self.slots)} slots")
        # Not zeros(): every element is written once below (values, or zeros for padding).
        buf = torch.empty(self.world, self.row_len, dtype=dtype, device=device)
        for k, slot in enumerate(self.slots):
            t = tensors[k]
            if consume:
                tensors[k] = None  # type: ignore[index]
            view = buf[:, slot.row_offset : slot.row_offset + slot.chunk]
            if t is None:
                view.zero_()
                continue
            _check(
                t.numel() == slot.numel,
                f"tensor {slot.index} has {t.numel()} elements, its slot {slot.numel}",
            )
            flat = t.detach().reshape(-1)
            full = slot.numel // slot.chunk if slot.chunk else 0  # rows filled completely
            if full:
                view[:full].copy_(flat[: full * slot.chunk].view(full, slot.chunk))
            rest = slot.numel - full * slot.chunk
            if rest:
                view[full, :rest].copy_(flat[full * slot.chunk :])
                view[full, rest:].zero_()
            view[full + (rest > 0) :].zero_()
            del t, flat  # with consume, the last reference to a gradient went with these
        return buf

    def unpack(self, buffer: Tensor) -> list[Tensor]:
        """Every slot's full tensor (new tensors, slot shapes) from a packed buffer."""
        buf = buffer.view(self.world, self.row_len)
        return [
            unshard(buf[:, s.row_offset : s.row_offset + s.chunk].unbind(0), s.shape)
            for s in self.slots
        ]

    def unpack_into(self, buffer: Tensor, outs: Sequence[Tensor]) -> None:
        """Copy every slot's full tensor from a packed buffer into ``outs`` (cast as needed)."""
        buf = buffer.view(self.world, self.row_len)
        for slot, out in zip(self.slots, outs, strict=True):
            cols = buf[:, slot.row_offset : slot.row_offset + slot.chunk]
            if not out.is_contiguous():  # rare: through a contiguous copy
                out.detach().copy_(cols.reshape(-1)[: slot.numel].view(out.shape))
                continue
            flat = out.detach().view(-1)
            full = slot.numel // slot.chunk if slot.chunk else 0  # rows that fit completely
            if full:  # one strided copy straight into the parameter
                flat[: full * slot.chunk].view(full, slot.chunk).copy_(cols[:full])
            rest = slot.numel - full * slot.chunk
            if rest:
                flat[full * slot.chunk :].copy_(cols[full, :rest])

    def row_views(self, row: Tensor) -> list[Tensor]:
        """Views into one row (a rank's share): each slot's chunk, padding included."""
        _check(row.numel() == self.row_len, f"row has {row.numel()} elements, not {self.row_len}")
        row = row.reshape(-1)
        return [row[s.row_offset : s.row_offset + s.chunk] for s in self.slots]

    def local_row(
        self, tensors: Sequence[Tensor | None], rank: int, dtype: torch.dtype | None = None
    ) -> Tensor:
        """Rank ``rank``'s row of ``pack(tensors)`` without building the whole buffer."""
        first = next((t for t in tensors if t is not None), None)
        if dtype is None:
            dtype = first.dtype if first is not None else torch.float32
        device = first.device if first is not None else torch.device("cpu")
        row = torch.zeros(self.row_len, dtype=dtype, device=device)
        for slot, t, view in zip(self.slots, tensors, self.row_views(row), strict=True):
            if t is not None:
                start, length = chunk_bounds(slot.numel, self.world, rank)
                view[:length].copy_(t.detach().reshape(-1)[start : start + length])
        return row

    def __repr__(self) -> str:
        return f"BucketLayout({len(self.slots)} tensors, world={self.world}, row={self.row_len})"


def build_buckets(
    shapes: Sequence[torch.Size],
    world: int,
    bucket_size: int,
    order: Sequence[int] | None = None,
    key: Callable[[int], object] | None = None,
) -> list[BucketLayout]:
    """Group tensors into buckets of about ``bucket_size`` elements (full tensors, not chunks).

    Tensors are taken in ``order`` (indices into ``shapes``; default 0..n-1); a bucket closes
    once it holds at least ``bucket_size`` elements, so a tensor larger than that gets a bucket
    of its own, and also whenever ``key(index)`` changes (a dtype or device: one buffer per
    bucket). Slots remember their index into ``shapes``.
    """
    if bucket_size <= 0:
        raise ConfigError(
            f"bucket size must be positive, got {bucket_size}",
            where="zero_optimization.reduce_bucket_size / allgather_bucket_size",
        )
    order = range(len(shapes)) if order is None else order
    numels = [torch.Size(s).numel() for s in shapes]
    return [
        BucketLayout([shapes[i] for i in indices], world, indices)
        for indices in group_into_buckets(numels, bucket_size, order, key)
    ]


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise ConfigError(what, where="zero.partition")
