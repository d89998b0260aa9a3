"""ZeRO's gradient reduction: bucketed reduce-scatters from full gradients into rank partitions.

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
  strictly in bucket order, so every rank issues the same collectives in the same order. At the
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

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from zerotron.distributed import comm
from zerotron.distributed.comm import Group, Pending
from zerotron.zero.partition import BucketLayout, build_buckets, full_shape

Deliver = Callable[[BucketLayout, Tensor], None]
"""``deliver(bucket, row)``: add a reduced, averaged row into the owner's partitions."""


class _Bucket:
    """One bucket: its layout, parameters, wire dtype, gradients counted in, collective."""

    def __init__(self, layout: BucketLayout, params: list[nn.Parameter], wire: torch.dtype):
        self.layout = layout
        self.params = params
        self.wire = wire
        self.ready = 0
        self.pending: Pending | None = None


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
        self.buckets = [
            _Bucket(
                lay,
                [self.params[i] for i in lay.indices],
                comm_dtype or self.params[lay.indices[0]].dtype,
            )
            for lay in layouts
        ]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._next_launch = 0
        self._callback_queued = False
        self.reduced_since_step = False
        """True once a reduction has delivered every bucket (reset by the optimizer's step)."""
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]

    # ---- during backward ------------------------------------------------------------------

    @torch.no_grad()
    def _on_grad(self, param: Tensor) -> None:
        if not (self.every_microbatch or self.sync):
            return  # stage 1 mid-accumulation: autograd keeps summing into p.grad
        self.queue_end_of_backward()  # normally done already, from the model's output
        self._bucket_of[id(param)].ready += 1
        self._launch_ready()

    def _launch_ready(self) -> None:
        """Launch, in bucket order, every bucket whose gradients are all in."""
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if bucket.ready < len(bucket.params):
                return
            self._launch(bucket)
            self._next_launch += 1

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
        for bucket in self.buckets[self._next_launch :]:
            self._launch(bucket)
        for bucket in self.buckets:
            if bucket.pending is not None:
                self._finish(bucket)
            bucket.ready = 0
        self._next_launch = 0
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
        return any(b.pending is not None for b in self.buckets)

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
