"""ZeRO's gradients: bucketed reduce-scatters from full gradients into this rank's partitions.

Each parameter's full gradient (``p.grad``, produced by autograd) must end up as this rank's
chunk of the data-parallel *mean*, accumulated over micro-batches. :class:`GradReducer` does
that with the rank-major buckets of :mod:`zerotron.zero.partition`: one bucket = one
``reduce_scatter`` that hands every rank its row (its chunks of the bucket's parameters).

- **When.** Stage 1 keeps full gradients in ``p.grad`` (autograd accumulates them over the
  micro-batches) and reduces once, on the micro-batch that ends the accumulation (``sync``).
  Stages 2 and 3 reduce on *every* micro-batch (DeepSpeed's stage 2) and free ``p.grad`` right
  away, so a full gradient lives only between its hook and its bucket's launch.
- **Overlap.** A post-accumulate-grad hook counts the parameters of each bucket; a bucket whose
  gradients are all in is launched asynchronously while backward goes on. Buckets launch
  strictly in bucket order, so every rank issues the same collectives in the same order
  (:class:`~zerotron.parallel.buckets.GradBuckets`, shared with data parallelism). At the
  end of the backward (an autograd callback) buckets still waiting (unused parameters: zeros)
  are launched and everything is waited for and added into the partitions.
- **Average.** As :mod:`zerotron.parallel.data_parallel`: the sum is divided by the group size
  after the reduction, so two ranks give ``(a + b) / 2``. DeepSpeed's
  ``gradient_predivide_factor`` f divides by f before and by N/f after;
  ``prescale_gradients`` divides by N before instead.
- **Wire.** Buckets are packed in ``communication_data_type`` (default: the parameters' dtype).
  ``reduce_scatter=False`` all-reduces the bucket and keeps the own row (DeepSpeed's option).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from zerotron.distributed import comm
from zerotron.distributed.comm import Group
from zerotron.parallel.buckets import GradBucket, GradBuckets
from zerotron.precision.grads import weak_hook
from zerotron.zero.masters import ParamInfo, SubGroup
from zerotron.zero.partition import BucketLayout, build_buckets, full_shape

Deliver = Callable[[BucketLayout, Tensor], None]
"""``deliver(bucket, row)``: add a reduced, averaged row into the owner's partitions."""


class _Bucket(GradBucket):
    """One bucket: a :class:`GradBucket` with its rank-major layout."""

    def __init__(
        self, index: int, layout: BucketLayout, params: list[nn.Parameter], wire: torch.dtype
    ):
        super().__init__(index, params, wire)
        self.layout = layout


class GradReducer:
    """Reduce-scatters parameter gradients into partitions (see the module docstring).

    Args:
        params: the parameters in the model's registration order (buckets take them reversed,
            roughly the order backward produces their gradients).
        group: the data-parallel group.
        deliver: called with each bucket and its reduced row, in bucket order.
        every_microbatch: reduce on every backward (stages 2, 3) rather than only when
            :attr:`sync` is set (stage 1).
        bucket_size: ``reduce_bucket_size`` (elements of full gradients per bucket).
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        group: Group,
        deliver: Deliver,
        *,
        every_microbatch: bool,
        bucket_size: int,
        overlap: bool = True,
        use_reduce_scatter: bool = True,
        comm_dtype: torch.dtype | None = None,
        predivide_factor: float = 1.0,
        prescale: bool = False,
    ):
        self.params = list(params)
        self.group = group
        self.deliver = deliver
        self.every_microbatch = every_microbatch
        self.overlap = overlap
        self.use_reduce_scatter = use_reduce_scatter
        self.predivide_factor = float(predivide_factor)
        self.prescale = prescale
        self.sync = True
        """Whether this backward reduces (stage 1; the Engine sets it on the last micro-batch)."""
        shapes = [full_shape(p) for p in self.params]
        # Backward reaches the last layers first: reversed order fills the first bucket first.
        layouts = build_buckets(
            shapes,
            group.size,
            bucket_size,
            order=reversed(range(len(self.params))),
            key=lambda i: (self.params[i].dtype, self.params[i].device),
        )
        buckets = [
            _Bucket(
                k,
                lay,
                [self.params[i] for i in lay.indices],
                comm_dtype or self.params[lay.indices[0]].dtype,
            )
            for k, lay in enumerate(layouts)
        ]
        self.buckets: GradBuckets[_Bucket] = GradBuckets(buckets, self._launch, self._finish)
        self._callback_queued = False
        self.reduced_since_step = False
        """True once a reduction has delivered every bucket (reset by the optimizer's step)."""
        self._hooks = [
            p.register_post_accumulate_grad_hook(weak_hook(self._on_grad)) for p in self.params
        ]

    # ---- during backward ------------------------------------------------------------------

    @torch.no_grad()
    def _on_grad(self, param: Tensor) -> None:
        if not (self.every_microbatch or self.sync):
            return  # stage 1 mid-accumulation: autograd keeps summing into p.grad
        self.queue_end_of_backward()  # normally done already, from the model's output
        self.buckets.grad_ready(param)

    def queue_end_of_backward(self, *_: Any) -> None:
        """Have :meth:`reduce_all` run when the current backward ends (once per backward).

        Called from a hook on the model's output, so the callback joins the *outermost*
        backward: a reentrant activation checkpoint runs a nested backward inside it, and a
        callback queued from there would end the reduction early (correct, but every bucket
        sent again, zeros and all, by the outer backward's own callback).
        """
        if not self._callback_queued and (self.every_microbatch or self.sync):
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._callback_queued = True

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        self.reduce_all()

    @torch.no_grad()
    def reduce_all(self) -> None:
        """Launch every bucket not launched yet (missing gradients count as zero), wait for all,
        deliver the rows. Every rank must call it at the same point."""
        self.buckets.flush()
        self.reduced_since_step = True

    def _launch(self, bucket: _Bucket) -> None:
        grads = [p.grad for p in bucket.params]
        for p in bucket.params:
            p.grad = None  # the full gradient's job is done: each is freed once packed
        buf = bucket.layout.pack(grads, dtype=bucket.wire, consume=True)
        n = self.group.size
        if self.prescale:
            buf.div_(n)
        elif self.predivide_factor != 1.0:
            buf.mul_(1.0 / self.predivide_factor)
        flat = buf.view(-1)
        if self.use_reduce_scatter:
            bucket.pending = comm.reduce_scatter_async(flat, self.group)
        else:
            bucket.pending = comm.all_reduce_async(flat, self.group)
        if not self.overlap:
            self._finish(bucket)

    def _finish(self, bucket: _Bucket) -> None:
        assert bucket.pending is not None
        out = bucket.pending.wait()
        bucket.pending = None
        row = out if self.use_reduce_scatter else out.view(self.group.size, -1)[self.group.rank]
        n = self.group.size
        if not self.prescale:
            if self.predivide_factor == 1.0:
                row.div_(n)
            elif self.predivide_factor != n:
                row.mul_(self.predivide_factor / n)
        self.deliver(bucket.layout, row)

    # ---- housekeeping ---------------------------------------------------------------------

    def in_flight(self) -> bool:
        return self.buckets.in_flight()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def describe(self) -> list[dict[str, Any]]:
        """One entry per bucket: elements on the wire, wire dtype, parameter count."""
        return [
            {"numel": b.layout.numel, "dtype": str(b.wire), "params": len(b.params)}
            for b in self.buckets
        ]


class GradPartitions:
    """This rank's gradient partitions: one flat tensor per sub-group (``SubGroup.grad``), into
    which :class:`GradReducer` delivers the reduced rows, allocated at the first delivery.

    Their dtype is ``accum_dtype`` if given, else the parameters'. With ``promote`` (stage 3
    with one copy of the partition, :attr:`ZeroOptimizer.shards_are_masters`, and no
    ``accum_dtype``) the first micro-batch's rows stay in their wire dtype: bf16 rows stored as
    bf16 are the very values an fp32 partition would hold (0 + x is exact), at half the bytes.
    A second micro-batch's rows are summed in fp32 (the partition is promoted first), so
    accumulation stays exact: without accumulation the rank holds 14 bytes per element of its
    partition, with it the ZeRO paper's 16 (4 master + 4 gradient + 8 Adam); the step's
    results are the same bits.
    """

    def __init__(
        self,
        sub_groups: Sequence[SubGroup],
        infos: Sequence[ParamInfo],
        *,
        accum_dtype: torch.dtype | None,
        promote: bool,
    ):
        self.sub_groups = sub_groups
        self.infos = infos
        self.accum_dtype = accum_dtype
        self.promote = promote

    @torch.no_grad()
    def deliver(self, layout: BucketLayout, row: Tensor, order: Sequence[ParamInfo], later: bool):
        """Add a bucket's reduced row into the partitions; ``order[slot.index]`` is each
        slot's parameter, ``later``: a micro-batch after the first since the step."""
        dsts, srcs = [], []
        for slot, view in zip(layout.slots, layout.row_views(row)):
            info = order[slot.index]
            sub = self.sub_groups[info.sub_group]
            if sub.grad is None:
                sub.grad = self.new(sub, row.dtype)
            elif later:
                self.to_fp32(sub)  # a second micro-batch is summed in fp32
            dsts.append(sub.grad[info.offset : info.offset + info.chunk])
            srcs.append(view)  # foreach add casts to the partition's dtype
        torch._foreach_add_(dsts, srcs)

    def new(self, sub: SubGroup, wire: torch.dtype | None = None) -> Tensor:
        """Zeros for ``sub``'s gradient (see the class docstring for the dtype)."""
        if self.promote:
            dtype = wire if wire is not None else torch.float32
        else:
            dtype = self.accum_dtype or sub.dtype
        return torch.zeros(sub.numel, dtype=dtype, device=sub.device)

    def to_fp32(self, sub: SubGroup) -> None:
        """Turn a wire-dtype partition (``promote``) fp32, exactly."""
        if self.promote and sub.grad is not None and sub.grad.dtype != torch.float32:
            sub.grad = sub.grad.float()

    def chunks(self, infos: Iterable[ParamInfo]) -> list[Tensor]:
        """Views of the partitions at these parameters' chunks (allocated if need be; a
        wire-dtype partition turns fp32 so sums over another group stay exact)."""
        out = []
        for info in infos:
            sub = self.sub_groups[info.sub_group]
            if sub.grad is None:
                sub.grad = self.new(sub)
            else:
                self.to_fp32(sub)
            out.append(sub.grad[info.offset : info.offset + info.chunk])
        return out

    def as_is(self) -> list[Tensor]:
        """Every sub-group's gradient partition as it is (zeros where nothing was reduced)."""
        for s in self.sub_groups:
            if s.grad is None:
                s.grad = self.new(s)
        return [s.grad for s in self.sub_groups]

    def fp32(self) -> list[Tensor]:
        """Every sub-group's gradient in fp32, kept as the partition (so an in-place unscale
        reaches the step; zeros where nothing was reduced)."""
        grads = []
        for s in self.sub_groups:
            g = s.grad if s.grad is not None else torch.zeros(s.numel, device=s.device)
            s.grad = g if g.dtype == torch.float32 else g.float()
            grads.append(s.grad)
        return grads

    def counted(self, grads: list[Tensor]) -> list[Tensor]:
        """The gradient elements this rank counts in the norm (its chunks of counted params)."""
        out = []
        for s, g in zip(self.sub_groups, grads):
            infos = [self.infos[k] for k in s.params]
            if all(i.counted for i in infos):
                out.append(g)
            else:
                out.extend(g[i.offset : i.offset + i.chunk] for i in infos if i.counted)
        return out

    def clear(self) -> None:
        """Drop every partition (reallocated at the next reduction)."""
        for s in self.sub_groups:
            s.grad = None
