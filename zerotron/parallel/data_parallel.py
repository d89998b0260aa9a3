"""Data parallelism: gradients averaged over the data-parallel group in buckets, during backward.

Every data-parallel rank holds the whole model (or its tensor/pipeline shard) and trains on its
own slice of the global batch; after backward, each gradient must be the mean over the ranks.

How :class:`DataParallel` does it (Megatron-core's DDP, in one screen):

- **Flat buffers.** Parameters are packed, in reverse registration order (roughly the order
  backward produces their gradients), into buckets of about ``bucket_size`` elements. Each
  bucket owns one contiguous fp32 buffer, and every parameter's ``main_grad`` is a view into it,
  so a bucket is reduced with one all-reduce.
- **Hooks.** A post-accumulate-grad hook per parameter adds the gradient autograd just produced
  into ``main_grad`` and drops ``.grad``. A parameter used twice (the tied embedding) fires once,
  after both uses have accumulated.
- **Overlap.** On the micro-batch that ends an accumulation (the Engine sets
  :attr:`DataParallel.sync`), a bucket whose parameters all have their gradient is all-reduced
  at once with an asynchronous collective while backward goes on with earlier layers.
  :meth:`DataParallel.finish_grad_sync` launches what is left and waits for everything.
  Buckets are launched strictly in bucket order, so every rank issues the same collectives in
  the same order even if hooks fire in a different order (grouping and launch order:
  :mod:`zerotron.parallel.buckets`, shared with ZeRO).
- **Once per step.** Micro-batches before the last only accumulate: no communication.
- **Average.** The sum is divided by the data-parallel size *after* the all-reduce (``avg``). With
  two ranks the result is ``(a + b) / 2`` exactly, the same bits as one process accumulating
  two half-weighted micro-batches. (Megatron divides before reducing, to keep fp16 sums in
  range; the buffers here are fp32, where that does not arise.)
- **Precision.** Gradients accumulate in fp32 whatever the parameter dtype (summing micro-batches
  in bf16 loses bits each time; :mod:`zerotron.precision.mixed` makes the same choice).
  The all-reduce runs on the fp32 buffer when ``reduce_in_fp32`` (Megatron's
  ``--accumulate-allreduce-grads-in-fp32``) or when the parameters are fp32; otherwise the bucket
  is cast to the parameters' 16-bit dtype for the wire (half the bytes) and back.

:class:`~zerotron.precision.mixed.MixedPrecisionOptimizer` must be built *after* this object: it
sees the ``main_grad`` views, leaves them to us, and steps from them directly.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from zerotron.distributed import comm
from zerotron.distributed.comm import Group
from zerotron.errors import ConfigError
from zerotron.parallel.buckets import GradBucket, GradBuckets, group_into_buckets
from zerotron.precision.grads import accumulate_grad_, weak_hook

DEFAULT_BUCKET_SIZE = 40_000_000
"""Elements per bucket, Megatron-core's default (``max(40M, 1M * dp)``)."""


def default_bucket_size(data_parallel_size: int) -> int:
    """Megatron-core's default bucket size for ``data_parallel_size`` ranks."""
    return max(DEFAULT_BUCKET_SIZE, 1_000_000 * data_parallel_size)


class Bucket(GradBucket):
    """A run of parameters whose gradients live in one flat fp32 buffer."""

    def __init__(self, index: int, params: list[nn.Parameter], comm_dtype: torch.dtype):
        super().__init__(index, params, comm_dtype)
        self.numel = sum(p.numel() for p in params)
        device = params[0].device
        self.buffer = torch.zeros(self.numel, dtype=torch.float32, device=device)
        offset = 0
        for p in params:
            p.main_grad = self.buffer[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        self._wire: Tensor | None = None

    def launch(self, group: Group) -> None:
        """Start averaging the buffer over ``group``."""
        wire = self.buffer if self.wire == torch.float32 else self.buffer.to(self.wire)
        self._wire = wire
        self.pending = comm.all_reduce_async(wire, group, op="avg")

    def wait(self) -> None:
        """Block until the average is in the buffer."""
        assert self.pending is not None
        self.pending.wait()
        if self._wire is not self.buffer:
            self.buffer.copy_(self._wire)
        self.pending = self._wire = None


class DataParallel:
    """Gradient averaging over ``group`` for ``params`` (see the module docstring).

    Args:
        params: the model's parameters, in registration order (``model.parameters()``); those
            that do not require a gradient are left out.
        group: the data-parallel group (``state().dp``).
        bucket_size: elements per bucket (``--ddp-bucket-size``); a bucket closes once it holds at
            least this many, so a parameter larger than it gets a bucket of its own. Default:
            :func:`default_bucket_size`.
        reduce_in_fp32: all-reduce 16-bit parameters' gradients in fp32 (see the docstring).
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        group: Group,
        *,
        bucket_size: int | None = None,
        reduce_in_fp32: bool = False,
    ):
        if bucket_size is None:
            bucket_size = default_bucket_size(group.size)
        if bucket_size <= 0:
            raise ConfigError(
                f"bucket size must be positive, got {bucket_size}", where="--ddp-bucket-size"
            )
        self.group = group
        self.bucket_size = bucket_size
        self.sync = True
        """Whether the next backward reduces (the Engine turns it on for the last micro-batch)."""
        params = [p for p in params if p.requires_grad]
        seen: set[int] = set()
        self.params = [p for p in params if not (id(p) in seen or seen.add(id(p)))]
        for p in self.params:
            if getattr(p, "main_grad", None) is not None:
                raise ConfigError(
                    "a parameter already has a main_grad buffer",
                    where="DataParallel",
                    fix="build DataParallel before MixedPrecisionOptimizer, and only once",
                )
        self.buckets: GradBuckets[Bucket] = GradBuckets(
            self._make_buckets(reduce_in_fp32), lambda b: b.launch(self.group), Bucket.wait
        )
        self._hooks = [
            p.register_post_accumulate_grad_hook(weak_hook(self._on_grad)) for p in self.params
        ]

    def _make_buckets(self, reduce_in_fp32: bool) -> list[Bucket]:
        """Reversed registration order (backward reaches the last layers first, so the first
        bucket fills first), grouped as :func:`~zerotron.parallel.buckets.group_into_buckets`."""
        order = list(reversed(range(len(self.params))))
        groups = group_into_buckets(
            [p.numel() for p in self.params],
            self.bucket_size,
            order,
            key=lambda i: (self.params[i].dtype, self.params[i].device),
        )
        buckets = []
        for k, indices in enumerate(groups):
            params = [self.params[i] for i in indices]
            dtype = params[0].dtype
            wire = torch.float32 if reduce_in_fp32 or dtype == torch.float32 else dtype
            buckets.append(Bucket(k, params, wire))
        return buckets

    # ---- during backward ------------------------------------------------------------------

    @torch.no_grad()
    def _on_grad(self, param: Tensor) -> None:
        accumulate_grad_(param.main_grad, param.grad)
        param.grad = None
        if self.sync:
            self.buckets.grad_ready(param)

    def finish_grad_sync(self) -> None:
        """Launch the buckets backward did not complete (unused parameters), then wait for all.

        After it, every ``main_grad`` holds the data-parallel mean. Call it after the last
        micro-batch's backward, before the optimizer step.
        """
        self.buckets.flush()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward inside the block only accumulates (as ``torch``'s DDP ``no_sync``)."""
        before, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = before

    # ---- housekeeping ---------------------------------------------------------------------

    def zero_grad(self) -> None:
        """Zero every bucket's buffer (the optimizer's ``zero_grad`` does the same per view)."""
        for bucket in self.buckets:
            bucket.buffer.zero_()

    @property
    def numel(self) -> int:
        """Gradient elements reduced per step (all buckets)."""
        return sum(b.numel for b in self.buckets)

    def describe(self) -> list[dict[str, Any]]:
        """One entry per bucket: its index, elements, wire dtype and parameter count."""
        return [
            {
                "index": b.index,
                "numel": b.numel,
                "dtype": str(b.wire),
                "params": len(b.params),
            }
            for b in self.buckets
        ]

    def remove_hooks(self) -> None:
        """Detach the gradient hooks (the ``main_grad`` views stay)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


@torch.no_grad()
def broadcast_parameters(params: Iterable[Tensor], group: Group) -> None:
    """Copy the group's first rank's ``params`` into every rank's (DeepSpeed's
    ``_broadcast_model`` at ``initialize``: replicas start from data-parallel rank 0's weights,
    whatever each rank's seed). Parameters held as ZeRO-3 shards (``zero_shard``) are skipped:
    their partitioning already started them from one rank's weights."""
    if group.size == 1:
        return
    for p in params:
        if hasattr(p, "zero_shard"):
            continue
        comm.broadcast(p.data, group, 0)
