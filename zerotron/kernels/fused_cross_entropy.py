"""The tied output layer and the cross entropy fused, in token chunks (one tensor-parallel rank).

``loss = cross_entropy(x @ W[:V]^T, target)`` per token, where the unfused path materializes the
``[tokens, V]`` logits (GPT-2: 2048 x 50257), casts them to fp32, keeps the fp32 softmax for
backward and runs three big matmuls and a dozen memory passes over it. Here the tokens are cut in
chunks and each chunk goes all the way through while its logits are hot in cache:

1. ``logits = x_c @ W^T`` in the parameters' dtype (bf16 stays bf16: the fast matmul);
2. the softmax in fp32 and the per-token loss;
3. the gradient wrt the logits right away, ``softmax - one_hot(target)`` (fp32, then cast to the
   parameters' dtype, as the unfused path's backward does);
4. ``grad_x_c = grad_logits @ W`` and ``grad_W += grad_logits^T @ x_c``.

Only ``grad_x`` ([tokens, h]) and ``grad_W`` ([V_pad, h]) survive the forward: no ``[tokens, V]``
tensor is saved, and none in fp32 ever exists beyond one chunk. Backward just scales them by the
incoming gradient. The loss is returned per token, so the caller may weight tokens (a loss mask):

- ``grad_x`` rows are per token: they are scaled by any per-token gradient exactly;
- ``grad_W`` sums over tokens, so it can only be rescaled when every token has the same upstream
  gradient (the usual case: a mean over an all-ones loss mask). Otherwise backward recomputes the
  chunks' logits and builds ``grad_W`` with the per-token weights (correct for any weighting, at
  the price of a second forward of the output layer).

Vocabulary padding: ``weight`` is the whole (padded) embedding ``[V_pad, h]``; only its first
``vocab_size`` rows take part, and ``grad_W`` is produced at the full ``[V_pad, h]`` shape with the
padding rows zero, so the tied embedding's gradient costs no slice-backward zero-fill and copy.

Numerics equal the unfused path up to rounding. fp32: the same operations in the same order per
element (loss and gradients within ~1e-6 relative; on CPU the three matmuls run on oneDNN, whose
fp32 GEMM is up to 2x torch.mm's MKL one on AMD CPUs, see
:mod:`~zerotron.kernels.onednn`, in vocabulary slices of :func:`slice_columns` so that no large
product comes out fresh, ``grad_x`` summed over the slices: see :meth:`_Chunks.products`).
16-bit: the same 16-bit
logits and fp32 loss (within ~2e-7), the softmax from ``torch.softmax``'s faster exp (~1e-5
relative, invisible after the cast to bf16) and ``grad_W`` accumulated over the chunks in bf16 (a
few bf16 ulps). With the kernel choice ``matmul16=fp32`` (:mod:`~zerotron.kernels.upcast`, a CPU
whose 16-bit GEMMs are emulated) the three products run on the fp32 GEMM from the same 16-bit
values, the logits rounded to 16 bits as before, and ``grad_W`` is summed over the chunks in fp32
and rounded once.

Tensor parallelism: this is the TP=1 (and eager-mode) path; the vocab-parallel loss is
:func:`~zerotron.parallel.tensor.cross_entropy.vocab_parallel_cross_entropy`.
"""

from __future__ import annotations

import torch

from zerotron.kernels.onednn import onednn_mm_t as _onednn_linear
from zerotron.kernels.onednn import onednn_mm_t_into as _onednn_linear_into
from zerotron.kernels.onednn import use_onednn as _use_onednn
from zerotron.kernels.policy import current_choices
from zerotron.kernels.tied_grad import TiedGrad
from zerotron.kernels.upcast import mm as upcast_mm
from zerotron.kernels.upcast import use_upcast as _use_upcast

# fp32 logits of one chunk, in bytes: large enough for efficient matmuls (the weight is re-read
# once per chunk), small enough to keep the buffers modest: 512 GPT-2 tokens (bench/README.md
# found 256 to 1024 within noise of each other).
DEFAULT_CHUNK_BYTES = 512 * 50257 * 4


# Vocabulary columns of one oneDNN product slice in the fp32 fused loss on CPU (its logits and
# grad_W come in vocabulary slices, see onednn_mm_t_into): 4 MB of fp32 for a 512-token chunk,
# below glibc's mmap threshold so the heap reuses them, large enough for full-speed GEMMs
# (bench/README.md: widths from 1,024 to 8,192 columns within noise of each other). Fixed, not
# sized by the chunk's token count: each token's grad_x sums the same slices in the same order
# however the tokens are cut into chunks (pipeline micro-batches, the last short chunk), so
# layouts give the same bits. The default of the kernel choice ``loss_chunk``
# (:class:`~zerotron.kernels.policy.KernelChoices`), which the chooser may set per machine.
SLICE_COLUMNS = 2048


def slice_columns() -> int:
    """Vocabulary columns per oneDNN product slice: this process's ``loss_chunk`` choice."""
    return current_choices().loss_chunk


def default_chunk_size(num_tokens: int, vocab_size: int) -> int:
    """Tokens per chunk for ``vocab_size`` logits: about ``DEFAULT_CHUNK_BYTES`` of fp32 logits,
    split evenly (so the last chunk is not a sliver)."""
    per_chunk = max(1, DEFAULT_CHUNK_BYTES // (4 * vocab_size))
    chunks = max(1, -(-num_tokens // per_chunk))
    return -(-num_tokens // chunks)


class ChunkWorkspace:
    """The ``[rows, V]`` chunk buffers, kept from one call to the next (on CPU only).

    On CPU a fresh buffer this large is mapped anew by the allocator on every call and each of
    its pages faults on first touch, as costly as several passes over it. The
    model keeps one workspace for its loss; on other devices the caching allocator already
    reuses blocks, so nothing is held between calls there.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(
        self,
        name: str,
        rows: int,
        cols: int,
        like: torch.Tensor,
        dtype: torch.dtype,
        row_stride: int | None = None,
    ):
        """An uninitialized ``[rows, cols]`` tensor of ``dtype`` on ``like``'s device; with
        ``row_stride`` (>= ``cols``), a view whose rows lie that many elements apart."""
        stride = cols if row_stride is None else row_stride
        if like.device.type != "cpu":
            return like.new_empty(rows, stride, dtype=dtype)[:, :cols]
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < rows * stride or buf.dtype != dtype:
            buf = self._buffers[name] = like.new_empty(rows * stride, dtype=dtype)
        return buf[: rows * stride].view(rows, stride)[:, :cols]

    def clear(self) -> None:
        """Drop the buffers (they are made again on the next call)."""
        self._buffers.clear()


def padded_row_stride(cols: int) -> int:
    """A row stride for ``[rows, cols]`` fp32 logits: ``cols`` rounded up to 64 elements.

    GPT-2's 50,257 columns make every row start at another misaligned address: torch.mm writing
    ``[512, 384] @ [384, 50257]`` fp32 into such rows took 334 ms against 240 ms into rows
    50,304 apart (one thread, the Zen 3 of bench/README.md); the elementwise passes do not care."""
    return -(-cols // 64) * 64


class _Chunks:
    """Token chunks of ``x`` and the buffers to push them through the output layer."""

    def __init__(self, x, weight, target, vocab_size, chunk_size, workspace, with_grad):
        self.x, self.target, self.size = x, target, chunk_size
        self.w = weight[:vocab_size]  # a contiguous prefix: no copy
        rows, v = min(chunk_size, x.shape[0]), vocab_size
        ws = self.workspace = workspace or ChunkWorkspace()
        # fp32: the products write and read the logits in place, rows padded (padded_row_stride).
        # 16-bit: kept contiguous; torch.softmax(out=) on padded rows ran 6x slower (copies).
        stride = padded_row_stride(v) if x.dtype == torch.float32 else None
        self.work = ws.get("fp32", rows, v, x, torch.float32, stride)
        # 16-bit: the logits come out of the matmul here, and the gradient goes back in here
        self.low = ws.get("16bit", rows, v, x, x.dtype) if x.dtype != torch.float32 else None
        # 16-bit on the fp32 GEMM (kernels/upcast.py): the weight's fp32 copy, made once a call
        self.w32 = None
        if self.low is not None and _use_upcast(x):
            self.w32 = ws.get("weight_fp32", v, x.shape[1], x, torch.float32).copy_(self.w)
        self.with_grad = with_grad
        self.sliced = self.low is None and _use_onednn(x)  # fp32 on CPU: see products()
        self.step = slice_columns()  # read once: every chunk is cut the same way

    @property
    def upcast(self) -> bool:
        """Whether the 16-bit products run on the fp32 GEMM (:mod:`~zerotron.kernels.upcast`)."""
        return self.w32 is not None

    def __iter__(self):
        for start in range(0, self.x.shape[0], self.size):
            yield slice(start, min(start + self.size, self.x.shape[0]))

    def products(
        self,
        rows: slice,
        loss: torch.Tensor | None,
        grad_x: torch.Tensor | None,
        acc: _GradW | None,
        scale: torch.Tensor | None = None,
    ) -> None:
        """One chunk: its per-token loss into ``loss``, ``grad_logits @ W`` into ``grad_x[rows]``
        and ``grad_logits^T @ x`` into ``acc`` (each skipped where None), ``grad_logits`` being
        ``softmax - one_hot(target)`` (rows times ``scale``, if given).

        fp32 on CPU (oneDNN, no ``out=``): the logits come in vocabulary slices into the reused
        buffer (:func:`~zerotron.kernels.onednn.onednn_mm_t_into`); after the softmax's
        statistics, ``grad_logits`` is made one vocabulary slice at a time into a small contiguous
        buffer, straight from the exponentials (``exp / sum``, the same operation per element as
        the whole-row path) and both of its products are taken while it is hot in cache
        (``grad_x`` sums its slices' ``[n, h]`` products; for ``grad_W``, oneDNN's wrapper still
        copies the transposed slice contiguous). Measured against the whole-row division pass,
        an explicit copy per ``grad_W`` slice and one ``grad_x`` GEMM over the whole row in
        bench/README.md. Elsewhere: :meth:`grad_logits` and two whole-chunk products.
        """
        if not self.sliced:
            g = self.grad_logits(rows, loss, scale)
            if g is None:
                return
            if self.upcast:  # g's 16-bit values in fp32, for the fp32 GEMM
                g = self.work[: g.shape[0]].copy_(g)
            if grad_x is not None:
                if self.upcast:
                    grad_x[rows].copy_(upcast_mm(g, self.w32))
                else:
                    _matmul(g, self.w, out=grad_x[rows])
            if acc is not None:
                acc.add(g, self.x[rows])
            return
        x, t = self.x[rows], self.target[rows].unsqueeze(1)
        n, v = x.shape[0], self.w.shape[0]
        work, step = self.work[:n], self.step
        _onednn_linear_into(work, x, self.w, step)
        stats = self._softmax(work, t, loss[rows].unsqueeze(1) if loss is not None else None)
        if stats is None or (grad_x is None and acc is None):
            return
        sum_exp, target_grad = stats
        token_scale = scale[rows].unsqueeze(1) if scale is not None else None
        if token_scale is not None:
            target_grad.mul_(token_scale)
        hits = _targets_by_slice(t.squeeze(1), target_grad.squeeze(1), step, v)
        gx = grad_x[rows] if grad_x is not None else None
        x_t = x.t()
        for start, (hit_rows, hit_cols, hit_grads) in zip(range(0, v, step), hits):
            cols = slice(start, min(start + step, v))
            g = self.workspace.get("grad_slice", n, cols.stop - start, x, torch.float32)
            torch.div(work[:, cols], sum_exp, out=g)
            if token_scale is not None:
                g.mul_(token_scale)
            if hit_rows.numel():
                g.index_put_((hit_rows, hit_cols), hit_grads)  # the targets' softmax - 1
            if gx is not None:
                part = _onednn_linear(g, self.w[cols].t())  # [n, h]
                if start == 0:
                    gx.copy_(part)
                else:
                    gx.add_(part)
            if acc is not None:
                acc.add_slice(g, x_t, cols)
        if acc is not None:
            acc.first = False

    def grad_logits(
        self, rows: slice, loss: torch.Tensor | None, scale: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """The chunk's per-token loss into ``loss``; returns ``softmax - one_hot(target)`` in
        ``x``'s dtype (rows times ``scale``, if given), or None without ``with_grad``.

        Everything happens in place in reused buffers: on CPU, mixed-dtype ``out=`` ops leave the
        vectorized path (~10x slower than a pass) and so does ``scatter_`` into bf16 (~1000x).
        """
        x, t = self.x[rows], self.target[rows].unsqueeze(1)
        n = x.shape[0]
        work = self.work[:n]
        if self.low is None:
            if _use_onednn(x):  # ahead of mm; in vocabulary slices into the reused buffer
                _onednn_linear_into(work, x, self.w, self.step)
            else:
                torch.mm(x, self.w.t(), out=work)
        else:
            low = self.low[:n]
            if self.upcast:  # the fp32 GEMM, rounded to 16 bits as a native one is
                low.copy_(upcast_mm(x, self.w32.t(), out=work))
            else:
                torch.mm(x, self.w.t(), out=low)
            work.copy_(low)
        out = loss[rows].unsqueeze(1) if loss is not None else None
        if self.low is None or not self.with_grad:
            grad = self._exact(work, t, out)
        else:
            grad = self._fast(work, t, out, low)
        if grad is None:
            return None
        if scale is not None:
            grad.mul_(scale[rows].unsqueeze(1))
        return grad if self.low is None else low.copy_(grad)

    def _exact(self, work, t, loss) -> torch.Tensor | None:
        """The unfused path's operations on each element, in its order (fp32: equal to ~1 ulp)."""
        stats = self._softmax(work, t, loss)
        if stats is None:
            return None
        sum_exp, target_grad = stats
        work.div_(sum_exp)
        return work.scatter_(1, t, target_grad)

    def _softmax(self, work, t, loss) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``work`` (logits) becomes ``exp(logits - max)``; the loss into ``loss``; returns the
        row sums and the targets' ``softmax - 1`` (None without ``with_grad``)."""
        work.sub_(work.amax(dim=1, keepdim=True))  # stability: exp never overflows
        target_logit = work.gather(1, t)  # logit[target] - max
        work.exp_()
        sum_exp = work.sum(dim=1, keepdim=True)
        if loss is not None:
            torch.sub(sum_exp.log(), target_logit, out=loss)
        if not self.with_grad:
            return None
        return sum_exp, work.gather(1, t).div_(sum_exp).sub_(1.0)

    def _fast(self, work, t, loss, logits) -> torch.Tensor:
        """16-bit gradients: ``torch.softmax`` in place, one fused pass at twice the speed of the
        separate max / exp / sum / divide. Its exp is less exact (probabilities within ~1e-5,
        far below the bf16 rounding the gradient gets next); the loss ``-log p[target]`` stays
        within ~2e-7 of the exact one, except where ``p[target]`` underflows fp32: those tokens
        take the log-sum-exp of their (16-bit) ``logits`` instead.
        """
        torch.softmax(work, dim=1, out=work)
        p_target = work.gather(1, t)
        if loss is not None:
            torch.neg(p_target.log(), out=loss)
            tiny = p_target < torch.finfo(torch.float32).tiny
            if bool(tiny.any()):
                i = tiny.squeeze(1).nonzero().squeeze(1)
                row = logits[i].float()
                loss[i] = torch.logsumexp(row, dim=1, keepdim=True) - row.gather(1, t[i])
        return work.scatter_(1, t, p_target.sub_(1.0))


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Per-token ``cross_entropy(x @ weight[:vocab_size]^T, target)``; see the module docstring."""

    @staticmethod
    def forward(ctx, x, weight, target, vocab_size, chunk_size, workspace, tied):
        need_x, need_w = ctx.needs_input_grad[:2]
        chunks = _Chunks(x, weight, target, vocab_size, chunk_size, workspace, need_x or need_w)
        loss = x.new_empty(x.shape[0], dtype=torch.float32)
        grad_x = torch.empty_like(x) if need_x else None
        grad_w = torch.empty_like(weight) if need_w else None
        if need_w:
            grad_w[vocab_size:].zero_()  # padding rows: the only ones not written below
        acc = _GradW(grad_w[:vocab_size], chunks.workspace, chunks.upcast) if need_w else None
        for rows in chunks:
            chunks.products(rows, loss, grad_x, acc)
        if acc is not None:
            acc.finish()
        ctx.args = (vocab_size, chunk_size, workspace)
        ctx.needs = (need_x, need_w)
        ctx.tied = tied
        ctx.save_for_backward(x, weight, target)
        # The gradients are held on ctx, not saved: backward hands them over and keeps no
        # reference, so autograd may give grad_w to the weight's .grad as it is (a saved tensor
        # is a second reference, and autograd adds or stores a fresh copy of a [V_pad, h] tensor).
        ctx.grads = (grad_x, grad_w)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        if ctx.grads is None:
            raise RuntimeError(
                "fused linear cross entropy: backward ran twice on one forward (retain_graph); "
                "its gradients are made in the forward and handed over once: run the forward again"
            )
        (grad_x, grad_w), ctx.grads = ctx.grads, None
        x, weight, target = ctx.saved_tensors
        need_x, need_w = ctx.needs
        if need_x:  # rows are tokens: any per-token gradient scales them exactly
            grad_x.mul_(grad_loss.unsqueeze(1))
        if need_w:
            if bool((grad_loss == grad_loss[0]).all()):
                grad_w.mul_(grad_loss[0])  # the same weight for every token (a plain mean)
            else:  # a sum over tokens: recompute it with each token's weight
                vocab_size, chunk_size, workspace = ctx.args
                chunks = _Chunks(x, weight, target, vocab_size, chunk_size, workspace, True)
                acc = _GradW(grad_w[:vocab_size], chunks.workspace, chunks.upcast)
                for rows in chunks:
                    chunks.products(rows, None, None, acc, scale=grad_loss)
                acc.finish()
            if ctx.tied is not None:  # the lookup adds its rows and returns it (tied_grad.py)
                ctx.tied.put(grad_w)
                grad_w = None
        return grad_x, grad_w, None, None, None, None, None


def _targets_by_slice(
    target: torch.Tensor, grads: torch.Tensor, step: int, vocab_size: int
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per vocabulary slice of ``step`` columns: the rows whose target falls in it, the target's
    column within the slice, and its gradient (from ``grads``, one per row)."""
    n_slices = -(-vocab_size // step)
    which = torch.div(target, step, rounding_mode="floor")
    order = torch.argsort(which, stable=True)
    counts = torch.bincount(which, minlength=n_slices).tolist()
    rows = order.split(counts)
    cols = (target - which * step)[order].split(counts)
    vals = grads[order].split(counts)
    return list(zip(rows, cols, vals))


def _matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """``out = a @ b``."""
    if _use_onednn(a):
        out.copy_(_onednn_linear(a, b.t()))
    else:
        torch.mm(a, b, out=out)


class _GradW:
    """``out = sum over chunks of grad_logits^T @ x`` (``out`` is ``[V, h]``).

    fp32 on CPU (oneDNN): :meth:`add_slice` per vocabulary slice, ``out[s] (+)= g_s^T @ x`` from
    a contiguous slice ``g_s`` of ``grad_logits`` (:meth:`_Chunks.products`), each ``[S, h]``
    product small enough for the heap to reuse (faster than one fresh ``[h, V]`` product added
    to a sum and transposed at the end, bench/README.md).
    16-bit on CPU: each chunk's product is taken transposed, ``x^T @ grad_logits`` (``[h, V]``),
    summed in a reused workspace buffer, and transposed into ``out`` once at the end: that layout
    is the faster one there, and the transposing copy costs less than it gains (bench/README.md).
    Elsewhere (fp32 on torch.mm, the GPU) ``addmm_`` accumulates into ``out`` directly: in fp32
    the transposed layout ran at 60 GFLOP/s against 88 for ``grad_logits^T @ x`` on the Zen 3
    of bench/README.md.
    """

    def __init__(self, out: torch.Tensor, workspace: ChunkWorkspace, upcast: bool = False):
        self.out = out
        self.sum_t: torch.Tensor | None = None  # [h, V] (CPU, 16-bit)
        self.sum32: torch.Tensor | None = None  # [V, h] (16-bit on the fp32 GEMM)
        if upcast:
            self.sum32 = workspace.get("grad_w_fp32", *out.shape, out, torch.float32)
        elif out.device.type == "cpu" and out.dtype != torch.float32:
            v, h = out.shape
            self.sum_t = workspace.get("grad_w_t", h, v, out, out.dtype)
        self.first = True  # the first chunk writes, the others add

    def add_slice(self, grad_slice: torch.Tensor, x_t: torch.Tensor, cols: slice) -> None:
        """``out[cols] (+)= grad_slice^T @ x`` by oneDNN; ``grad_slice`` ``[n, S]`` contiguous,
        ``x_t`` is ``x^T`` ``[h, n]``. The caller clears ``first`` after a chunk's slices."""
        product = _onednn_linear(grad_slice.t(), x_t)  # [S, h]
        if self.first:
            self.out[cols].copy_(product)
        else:
            self.out[cols].add_(product)

    def add(self, grad_logits: torch.Tensor, x: torch.Tensor) -> None:
        """One chunk's ``grad_logits^T @ x`` (all paths but fp32 on oneDNN)."""
        if self.sum32 is not None:  # fp32 sums of the 16-bit values, rounded once in finish()
            if self.first:
                upcast_mm(grad_logits.t(), x, out=self.sum32)
            else:
                self.sum32.addmm_(grad_logits.t(), x.float())
        elif self.sum_t is not None:
            if self.first:
                torch.mm(x.t(), grad_logits, out=self.sum_t)
            else:
                self.sum_t.addmm_(x.t(), grad_logits)
        elif self.first:
            torch.mm(grad_logits.t(), x, out=self.out)
        else:
            self.out.addmm_(grad_logits.t(), x)
        self.first = False

    def finish(self) -> None:
        if self.sum32 is not None:
            self.out.copy_(self.sum32)
        elif self.sum_t is not None:
            self.out.copy_(self.sum_t.t())
            self.sum_t = None


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    vocab_size: int | None = None,
    chunk_size: int | None = None,
    workspace: ChunkWorkspace | None = None,
    tied: TiedGrad | None = None,
) -> torch.Tensor:
    """Per-token cross entropy (fp32, ``target``'s shape) of the logits ``hidden @ weight^T``.

    ``hidden`` [..., h] and ``weight`` [V_pad, h] share a dtype (fp32 or 16-bit); only the first
    ``vocab_size`` rows of ``weight`` are the vocabulary (default: all). ``target`` [...] holds
    ids below ``vocab_size``. ``chunk_size`` tokens go through at a time (default: about 100 MB
    of fp32 logits, see :func:`default_chunk_size`). ``workspace`` keeps the chunk buffers for
    the next call (see :class:`ChunkWorkspace`). Gradients reach ``hidden`` and ``weight``; the
    full logits are never materialized. ``tied``: the weight is also looked up by
    :func:`~zerotron.kernels.tied_grad.embedding_lookup` with this slot, before this
    loss and on the path to it; the weight gradient goes to the slot, and the lookup's backward
    returns it with its own rows added.
    """
    v = weight.shape[0] if vocab_size is None else vocab_size
    x = hidden.reshape(-1, hidden.shape[-1])
    t = target.reshape(-1)
    n = chunk_size or default_chunk_size(x.shape[0], v)
    loss = _FusedLinearCrossEntropy.apply(x, weight, t, v, n, workspace, tied)
    return loss.view(target.shape)
