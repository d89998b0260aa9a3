"""The tied output layer and the cross entropy fused, in token chunks (one tensor-parallel rank).

``loss = cross_entropy(x @ W[:V]^T, target)`` per token, where the unfused path materializes the
``[tokens, V]`` logits (GPT-2: 2048 x 50257), casts them to fp32, keeps the fp32 softmax for
backward and runs three big matmuls and a dozen memory passes over it. Here the tokens are cut in
chunks and each chunk goes all the way through while its logits are hot in cache:

1. ``logits = x_c @ W^T`` in the parameters' dtype (bf16 stays bf16: the fast matmul);
2. the log-sum-exp in fp32 (max, ``exp(logit - max)``, sum) and the per-token loss;
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

Numerics equal the unfused path up to rounding (fp32: the same operations in the same order per
element; bf16: ``grad_W`` is accumulated over chunks in bf16, a few bf16 ulps).

Tensor parallelism: this is the TP=1 (and eager-mode) path; the vocab-parallel loss is
:func:`~zerotron.parallel.tensor.cross_entropy.vocab_parallel_cross_entropy`.
"""

from __future__ import annotations

import torch

# fp32 logits of one chunk, in bytes: large enough for efficient matmuls (the weight is re-read
# once per chunk), small enough that the chunk's memory passes stay cheap. Measured on a 2-core
# CPU for GPT-2's vocabulary (see bench/README.md): 1024 tokens per chunk.
DEFAULT_CHUNK_BYTES = 1024 * 50257 * 4


def default_chunk_size(num_tokens: int, vocab_size: int) -> int:
    """Tokens per chunk for ``vocab_size`` logits: about ``DEFAULT_CHUNK_BYTES`` of fp32 logits,
    split evenly (so the last chunk is not a sliver)."""
    per_chunk = max(1, DEFAULT_CHUNK_BYTES // (4 * vocab_size))
    chunks = max(1, -(-num_tokens // per_chunk))
    return -(-num_tokens // chunks)


def _chunk_grad_logits(
    x: torch.Tensor,
    w: torch.Tensor,
    target: torch.Tensor,
    logits: torch.Tensor | None,
    work: torch.Tensor,
    grad_logits: torch.Tensor,
    loss: torch.Tensor | None,
    with_grad: bool,
) -> None:
    """One chunk: its per-token loss into ``loss`` and (``with_grad``) ``softmax - one_hot``
    into ``grad_logits`` (``x.dtype``). ``logits`` is a ``x.dtype`` buffer (None for fp32),
    ``work`` an fp32 buffer; both ``[rows, V]``, reused across chunks (no large allocations)."""
    # Every step works in place on reused buffers: on CPU, mixed-dtype ``out=`` ops fall off
    # the vectorized path and a fresh [rows, V] allocation costs page faults (each ~10x a pass).
    t = target.unsqueeze(1)
    if logits is None:  # fp32: the logits buffer is the work buffer
        torch.mm(x, w.t(), out=work)
    else:
        torch.mm(x, w.t(), out=logits)
        work.copy_(logits)
    work.sub_(work.amax(dim=1, keepdim=True))  # stability: exp never overflows
    target_logit = work.gather(1, t)  # logit[target] - max
    work.exp_()
    sum_exp = work.sum(dim=1, keepdim=True)
    if loss is not None:
        torch.sub(sum_exp.log(), target_logit, out=loss.unsqueeze(1))
    if not with_grad:
        return
    # d loss / d logits = softmax - one_hot(target), in fp32 (as the unfused path's backward)
    target_grad = work.gather(1, t).div_(sum_exp).sub_(1.0)
    work.div_(sum_exp)
    work.scatter_(1, t, target_grad)  # (scatter_ into bf16 is ~1000x slower on CPU)
    if grad_logits is not work:
        grad_logits.copy_(work)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Per-token ``cross_entropy(x @ weight[:vocab_size]^T, target)``; see the module docstring."""

    @staticmethod
    def forward(ctx, x, weight, target, vocab_size: int, chunk_size: int) -> torch.Tensor:
        need_x, need_w = ctx.needs_input_grad[:2]
        with_grad = need_x or need_w
        n_tok, v = x.shape[0], vocab_size
        w = weight[:v]  # a contiguous prefix: no copy
        loss = torch.empty(n_tok, dtype=torch.float32, device=x.device)
        grad_x = torch.empty_like(x) if need_x else None
        grad_w = torch.empty_like(weight) if need_w else None
        if need_w:
            grad_w[v:].zero_()  # padding rows: only they are filled
        rows = min(chunk_size, n_tok)
        work = x.new_empty(rows, v, dtype=torch.float32)
        low = x.dtype != torch.float32
        logits = x.new_empty(rows, v) if low else None
        grad_logits = x.new_empty(rows, v) if (low and with_grad) else work
        for start in range(0, n_tok, chunk_size):
            end = min(start + chunk_size, n_tok)
            n = end - start
            xc = x[start:end]
            g = grad_logits[:n]
            _chunk_grad_logits(
                xc,
                w,
                target[start:end],
                logits[:n] if low else None,
                work[:n],
                g,
                loss[start:end],
                with_grad,
            )
            if need_x:
                torch.mm(g, w, out=grad_x[start:end])
            if need_w:
                if start == 0:
                    torch.mm(g.t(), xc, out=grad_w[:v])
                else:
                    grad_w[:v].addmm_(g.t(), xc)
        ctx.vocab_size, ctx.chunk_size = vocab_size, chunk_size
        ctx.needs = (need_x, need_w)
        ctx.save_for_backward(x, weight, target, grad_x, grad_w)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        x, weight, target, grad_x, grad_w = ctx.saved_tensors
        need_x, need_w = ctx.needs
        scale = grad_loss.unsqueeze(1)
        if need_x:  # rows are tokens: any per-token gradient scales them exactly
            grad_x.mul_(scale)
        if need_w:
            if bool((grad_loss == grad_loss[0]).all()):
                grad_w.mul_(grad_loss[0])  # the same weight for every token
            else:
                _weighted_grad_w(
                    x, weight, target, grad_loss, ctx.vocab_size, ctx.chunk_size, grad_w
                )
        return grad_x, grad_w, None, None, None


def _weighted_grad_w(x, weight, target, grad_loss, v, chunk_size, out) -> None:
    """``grad_W = sum_t grad_loss[t] * (softmax_t - one_hot_t)^T x_t``, recomputed by chunks."""
    w = weight[:v]
    rows = min(chunk_size, x.shape[0])
    work = x.new_empty(rows, v, dtype=torch.float32)
    low = x.dtype != torch.float32
    logits = x.new_empty(rows, v) if low else None
    grad_logits = x.new_empty(rows, v) if low else work
    for start in range(0, x.shape[0], chunk_size):
        end = min(start + chunk_size, x.shape[0])
        n = end - start
        g = grad_logits[:n]
        _chunk_grad_logits(
            x[start:end], w, target[start:end], logits[:n] if low else None, work[:n], g, None, True
        )
        g.mul_(grad_loss[start:end].unsqueeze(1))
        if start == 0:
            torch.mm(g.t(), x[start:end], out=out[:v])
        else:
            out[:v].addmm_(g.t(), x[start:end])


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    vocab_size: int | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Per-token cross entropy (fp32, ``target``'s shape) of the logits ``hidden @ weight^T``.

    ``hidden`` [..., h] and ``weight`` [V_pad, h] share a dtype (fp32 or 16-bit); only the first
    ``vocab_size`` rows of ``weight`` are the vocabulary (default: all). ``target`` [...] holds
    ids below ``vocab_size``. ``chunk_size`` tokens go through at a time (default: about 200 MB
    of fp32 logits for GPT-2's vocabulary, see :func:`default_chunk_size`). Gradients reach
    ``hidden`` and ``weight``; the full logits are never materialized.
    """
    v = weight.shape[0] if vocab_size is None else vocab_size
    x = hidden.reshape(-1, hidden.shape[-1])
    t = target.reshape(-1)
    n = chunk_size or default_chunk_size(x.shape[0], v)
    loss = _FusedLinearCrossEntropy.apply(x, weight, t, v, n)
    return loss.view(target.shape)
