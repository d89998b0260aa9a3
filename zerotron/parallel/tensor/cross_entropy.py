"""Cross entropy over logits split by vocabulary across tensor-parallel ranks.

Rank r holds the logits of vocabulary ids ``[r * V/tp, (r + 1) * V/tp)``. The loss
``logsumexp(logits) - logits[target]`` needs only three all-reduces of ``[tokens]`` scalars
(Megatron-LM's algorithm), never the full-vocabulary logits on one rank:

1. the max over the vocabulary (``max``), subtracted for a stable ``exp``;
2. the target's logit, which lives on exactly one rank (the others contribute 0; ``sum``);
3. the sum of exponentials (``sum``).

Backward is local: ``softmax - one_hot(target)`` on this rank's columns.

Vocabulary padding: columns whose logit is ``-inf`` (the model masks ids ``>= orig_vocab_size``)
get probability 0 and gradient 0, so they change neither the loss nor training.
"""

from __future__ import annotations

import torch

from zerotron.distributed import comm
from zerotron.distributed.comm import Group
from zerotron.distributed.state import state


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss, computed in place on ``logits`` (this rank's vocabulary columns).

    The logits buffer becomes the softmax, which backward turns into the gradient in place: no
    full-vocabulary copy is made (3x faster than ``F.cross_entropy`` on CPU, which scatters into
    a fresh zero tensor in backward). The caller's ``logits`` are consumed, and backward can run
    once only (no ``retain_graph``).
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group: Group) -> torch.Tensor:
        # stability: exp never overflows (any per-token constant cancels; the max is detached)
        logits.sub_(comm.all_reduce(logits.amax(dim=-1), group, op="max").unsqueeze(-1))
        if group.size == 1:
            local_target, outside = target, None
            predicted = logits.gather(-1, target.unsqueeze(-1)).squeeze(-1)
        else:
            start = group.rank * logits.shape[-1]
            local_target = target - start
            outside = (local_target < 0) | (local_target >= logits.shape[-1])
            local_target = local_target.masked_fill(outside, 0)
            predicted = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
            predicted = comm.all_reduce(predicted.masked_fill(outside, 0.0), group)
        logits.exp_()
        sum_exp = comm.all_reduce(logits.sum(dim=-1), group)
        loss = sum_exp.log() - predicted
        logits.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(logits, local_target, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax  # d loss / d logits = softmax - one_hot(target)
        minus_one = torch.full_like(local_target, -1, dtype=grad.dtype)
        if outside is not None:  # the target is another rank's column
            minus_one.masked_fill_(outside, 0.0)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), minus_one.unsqueeze(-1))
        grad.mul_(grad_output.unsqueeze(-1))
        return grad, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, group: Group | None = None
) -> torch.Tensor:
    """Per-token cross entropy in fp32.

    ``logits`` [..., V/tp] are this rank's vocabulary columns (any float dtype; rank r holds ids
    ``r * V/tp ...``), ``target`` [...] full-vocabulary ids, the same on every TP rank. ``group``
    defaults to the tensor-parallel group; at size 1 this is the plain cross entropy.

    ``logits`` are consumed when already fp32 (they become the saved softmax); pass a copy if
    you still need them.
    """
    g = state().tp if group is None else group
    shape = target.shape
    logits = logits.reshape(-1, logits.shape[-1]).float()
    loss = _VocabParallelCrossEntropy.apply(logits, target.reshape(-1), g)
    return loss.view(shape)
