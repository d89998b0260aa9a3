"""The tied word embedding's two gradients summed in one tensor, in place (one TP rank).

GPT-2 ties the output layer to the word embedding, so the weight gets two gradients per
micro-batch: the fused loss's dense ``[V_pad, h]`` one and the lookup's, a few rows. Left to
autograd, adding them costs a full ``[V_pad, h]`` tensor more than needed: the lookup's dense
gradient is a zero-filled ``[V_pad, h]`` tensor (``embedding_dense_backward``) and a sparse one
is added out of place (a fresh copy of the dense gradient). On CPU a fresh tensor that large is a
fresh mapping whose every page faults on first touch, which costs far more than adding the
micro-batch's rows in place (bench/README.md has the numbers).

:class:`TiedGrad` routes the loss's gradient through the lookup. The fused loss's backward
(which runs first: the lookup's output feeds everything before the loss) leaves its ``grad_w``
in the slot and returns none for the weight; the lookup's backward (:func:`embedding_lookup`)
adds its rows into that tensor, in token order, and returns it as the weight's gradient. Each
micro-batch's forward has its own slot, so autograd still sums micro-batches (and whatever else
reaches the weight) as usual. Without a loss gradient in the slot (the loss did not need one)
the lookup returns its own dense gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class TiedGrad:
    """One forward's slot for the fused loss's gradient of the tied weight (see the module)."""

    def __init__(self) -> None:
        self.grad: torch.Tensor | None = None

    def put(self, grad: torch.Tensor) -> None:
        """The loss's backward: leave its full gradient of the tied weight for the lookup."""
        self.grad = grad

    def take(self) -> torch.Tensor | None:
        """The lookup's backward: the loss's gradient, once; the slot keeps no reference (so
        autograd may hand the tensor to ``.grad`` without a copy)."""
        grad, self.grad = self.grad, None
        return grad


class _TiedLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, weight, tied):
        ctx.save_for_backward(tokens)
        ctx.tied = tied
        ctx.shape = weight.shape
        return F.embedding(tokens, weight)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (tokens,) = ctx.saved_tensors
        rows = grad_out.reshape(-1, grad_out.shape[-1])
        grad = ctx.tied.take()
        if grad is None:  # the loss gave the weight no gradient: the lookup's own
            grad = rows.new_zeros(ctx.shape)
        assert grad.shape == ctx.shape, "TiedGrad: the loss's gradient is another weight's"
        return None, grad.index_add_(0, tokens.reshape(-1), rows), None


def embedding_lookup(
    tokens: torch.Tensor, weight: torch.Tensor, tied: TiedGrad | None = None
) -> torch.Tensor:
    """``F.embedding(tokens, weight)``; with ``tied`` (which the fused loss of this forward on the
    same weight was given), the weight's gradient is the loss's with the lookup's rows added in
    place (see the module docstring)."""
    if tied is None or not weight.requires_grad:
        return F.embedding(tokens, weight)
    return _TiedLookup.apply(tokens, weight, tied)
