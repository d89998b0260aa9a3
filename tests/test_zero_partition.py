"""ZeRO's chunk and bucket layout (zerotron.zero.partition), N ranks simulated in one process."""

from __future__ import annotations

import pytest
import torch

from zerotron.errors import ConfigError
from zerotron.zero.partition import (
    BucketLayout,
    build_buckets,
    chunk_bounds,
    chunk_size,
    padded_view,
    shard,
    unshard,
)

SHAPES = [torch.Size(s) for s in [(7, 3), (5,), (1,), (4, 4), (2, 3, 5), (3,)]]


def _tensors(shapes, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


@pytest.mark.parametrize("numel,world", [(21, 1), (21, 2), (21, 4), (5, 8), (1, 3), (0, 2)])
def test_chunks_cover_the_tensor_once(numel, world):
    chunk = chunk_size(numel, world)
    assert chunk == -(-numel // world)
    covered = []
    for r in range(world):
        start, length = chunk_bounds(numel, world, r)
        assert start == r * chunk and 0 <= length <= chunk
        covered.extend(range(start, start + length))
    assert covered == list(range(numel))


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_shard_then_unshard_is_identity(world):
    for t in _tensors(SHAPES):
        chunks = [shard(t, world, r) for r in range(world)]
        assert all(c.numel() == chunk_size(t.numel(), world) for c in chunks)
        assert torch.equal(unshard(chunks, t.shape), t)
        # Padding is zero, and the padded view lines up with the chunks.
        view = padded_view(t.reshape(-1), world)
        assert torch.equal(view, torch.stack(chunks))
        assert view[-1, chunk_bounds(t.numel(), world, world - 1)[1] :].eq(0).all()


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pack_then_unpack_is_identity(world, dtype):
    tensors = _tensors(SHAPES, dtype)
    layout = BucketLayout(SHAPES, world, range(len(SHAPES)))
    assert layout.row_len == sum(chunk_size(s.numel(), world) for s in SHAPES)
    buf = layout.pack(tensors)
    assert buf.shape == (world, layout.row_len) and buf.dtype == dtype
    for t, out in zip(tensors, layout.unpack(buf)):
        assert out.shape == t.shape and torch.equal(out, t)
    outs = [torch.empty_like(t) for t in tensors]
    layout.unpack_into(buf.reshape(-1), outs)
    assert all(torch.equal(o, t) for o, t in zip(outs, tensors))
    # a non-contiguous destination (a transposed view) gets the same values
    strided = [
        torch.empty(t.shape[::-1], dtype=dtype).t() if t.dim() == 2 else None for t in tensors
    ]
    outs = [s if s is not None else torch.empty_like(t) for s, t in zip(strided, tensors)]
    layout.unpack_into(buf, outs)
    assert all(torch.equal(o, t) for o, t in zip(outs, tensors))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_row_r_holds_every_tensors_chunk_r(world):
    tensors = _tensors(SHAPES)
    layout = BucketLayout(SHAPES, world, range(len(SHAPES)))
    buf = layout.pack(tensors)
    for r in range(world):
        views = layout.row_views(buf[r])
        for t, v in zip(tensors, views):
            assert torch.equal(v, shard(t, world, r))
        assert torch.equal(layout.local_row(tensors, r), buf[r])


def test_simulated_reduce_scatter_and_all_gather():
    """Summing N ranks' packed buffers and handing out rows = each rank's chunk of the sums;
    concatenating every rank's row rebuilds every full tensor (what the collectives do)."""
    world = 3
    layout = BucketLayout(SHAPES, world, range(len(SHAPES)))
    per_rank = [_tensors(SHAPES) for _ in range(world)]
    for r in range(world):
        per_rank[r] = [t * (r + 1) for t in per_rank[r]]
    summed = torch.stack([layout.pack(ts) for ts in per_rank]).sum(0)
    flat = summed.reshape(-1)
    rows = list(flat.chunk(world))  # reduce_scatter's output on each rank
    expected = [sum(ts[i] for ts in per_rank) for i in range(len(SHAPES))]
    for r, row in enumerate(rows):
        for e, v in zip(expected, layout.row_views(row)):
            assert torch.equal(v, shard(e, world, r))
    gathered = torch.cat(rows)  # all_gather of the rows
    for e, out in zip(expected, layout.unpack(gathered)):
        assert torch.equal(out, e)


def test_pack_casts_and_takes_missing_tensors_as_zero():
    tensors = _tensors(SHAPES)
    tensors[1] = None
    layout = BucketLayout(SHAPES, 2, range(len(SHAPES)))
    buf = layout.pack(tensors, dtype=torch.bfloat16)
    assert buf.dtype == torch.bfloat16
    outs = layout.unpack(buf)
    assert outs[1].eq(0).all()
    assert torch.equal(outs[0], tensors[0].to(torch.bfloat16))


def test_build_buckets_by_size_order_and_key():
    shapes = [torch.Size([n]) for n in (10, 10, 30, 5, 5, 5)]
    buckets = build_buckets(shapes, 2, bucket_size=20)
    assert [b.indices for b in buckets] == [[0, 1], [2], [3, 4, 5]]
    rev = build_buckets(shapes, 2, 20, order=reversed(range(6)))
    assert [b.indices for b in rev] == [[5, 4, 3, 2], [1, 0]]
    dtypes = [torch.float32, torch.float32, torch.bfloat16, torch.bfloat16, torch.float32, None]
    keyed = build_buckets(shapes, 2, 1000, key=lambda i: dtypes[i])
    assert [b.indices for b in keyed] == [[0, 1], [2, 3], [4], [5]]
    # Slots carry the original index and their offsets within a row.
    b = buckets[2]
    assert [(s.index, s.chunk, s.row_offset) for s in b.slots] == [(3, 3, 0), (4, 3, 3), (5, 3, 6)]
    assert b.numel == 2 * b.row_len == 18


def test_bad_sizes_are_errors():
    with pytest.raises(ConfigError, match="bucket size"):
        build_buckets([torch.Size([3])], 2, 0)
    with pytest.raises(ConfigError, match="ranks"):
        chunk_size(3, 0)
    layout = BucketLayout([torch.Size([3])], 2, [0])
    with pytest.raises(ConfigError, match="elements"):
        layout.pack([torch.zeros(4)])


def test_pack_writes_every_element(monkeypatch):
    """The buffer starts uninitialized: padding and missing tensors must be written as zeros."""
    real_full = torch.full

    def garbage_empty(*shape, dtype=None, device=None):
        return real_full(shape, float("nan"), dtype=dtype, device=device)

    tensors = _tensors(SHAPES)
    tensors[2] = None
    layout = BucketLayout(SHAPES, 4, range(len(SHAPES)))
    monkeypatch.setattr(torch, "empty", garbage_empty)
    buf = layout.pack(tensors)
    monkeypatch.undo()
    assert not buf.isnan().any()
    for r in range(4):
        for t, view in zip(tensors, layout.row_views(buf[r])):
            want = torch.zeros_like(view) if t is None else shard(t, 4, r)
            assert torch.equal(view, want)
