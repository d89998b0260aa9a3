"""Gradients of the parameters that sequence parallelism leaves replicated but sees in shards.

Under ``--sequence-parallel`` the LayerNorms, the row-parallel biases and the position
embeddings are replicated on every TP rank, but each rank runs them on its own sequence shard:
each rank's gradient is the sum over its tokens only. The full gradient is the sum over the TP
ranks. Such parameters carry ``param.sequence_parallel = True`` (set by the layers and the
model), and :func:`allreduce_sequence_parallel_grads` sums their gradients across the TP group.

Call it explicitly (no hooks), once per optimizer step: after the last micro-batch's backward and
before gradient clipping, the optimizer step, or data-parallel averaging, which must all see the
full gradient. One call covers any number of accumulated micro-batches, since the sum is linear.
All marked gradients of one dtype travel in one flat all-reduce.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from zerotron.distributed import comm
from zerotron.distributed.comm import Group
from zerotron.distributed.state import state


def sequence_parallel_params(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of ``model`` marked ``sequence_parallel``, in registration order."""
    return [p for p in model.parameters() if getattr(p, "sequence_parallel", False)]


def mark_sequence_parallel(params: Iterable[nn.Parameter]) -> None:
    """Mark replicated parameters that run on sequence shards (their grads need a TP sum)."""
    for p in params:
        p.sequence_parallel = True


def allreduce_sequence_parallel_grads(model: nn.Module, group: Group | None = None) -> None:
    """Sum the gradients of ``model``'s ``sequence_parallel`` parameters across the TP group.

    A no-op at TP=1 or when no parameter is marked; parameters without a gradient are skipped
    (the same ones on every TP rank, since the ranks run the same graph).
    """
    g = state().tp if group is None else group
    if g.size == 1:
        return
    grads = [p.grad for p in sequence_parallel_params(model) if p.grad is not None]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in grads:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for same in by_dtype.values():
        flat = comm.all_reduce(torch.cat([t.reshape(-1) for t in same]), g)
        offset = 0
        for t in same:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
