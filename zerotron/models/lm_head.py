"""The language-model head: the output layer tied to the word embedding, and the loss.

``LMHead(x, weight, labels)`` turns the final hidden states ``[b, s, h]`` into logits
``[b, s, vocab_size]`` or, with ``labels``, the per-token loss ``[b, s]`` (fp32). ``weight`` is
the word-embedding matrix (GPT-2 ties the two), passed in by the caller: the GPT's own
embedding, or on a pipeline's last stage its copy of it. The head holds no parameter.

Vocabulary padding: the embedding has ``vocab_size`` rows, padded for efficient splitting; ids
``>= orig_vocab_size`` are never real tokens. Their logits are ``-inf`` and the loss is taken
over the real vocabulary only, so neither training nor sampling ever sees them.

Which loss (the kernel policy of the hidden states' device, :mod:`zerotron.kernels.policy`):

- tensor parallel: this rank's vocabulary rows, then the vocab-parallel cross entropy
  (:func:`~zerotron.parallel.tensor.vocab_parallel_cross_entropy`);
- TP=1 with the policy's ``fused_loss`` (the CPU): the output layer and the loss fused in token
  chunks (:func:`~zerotron.kernels.fused_linear_cross_entropy`), no ``[b, s, vocab]`` logits,
  run eagerly under ``torch.compile``;
- otherwise (CUDA): ``F.cross_entropy`` over the logits, which compiles with the rest.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from zerotron.distributed.comm import Group
from zerotron.kernels import ChunkWorkspace, TiedGrad, fused_linear_cross_entropy, kernel_policy
from zerotron.parallel.tensor import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    tp_group_attribute,
    vocab_parallel_cross_entropy,
)


class LMHead(nn.Module):
    """Tied output layer + loss over the real vocabulary (see the module docstring)."""

    tp_group = tp_group_attribute()

    def __init__(
        self,
        vocab_size: int,
        orig_vocab_size: int,
        tp_group: Group,
        *,
        vocab_start_index: int = 0,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        self.vocab_size = vocab_size  # padded: the embedding's rows
        self.orig_vocab_size = orig_vocab_size  # the tokenizer's
        self.tp_group = tp_group
        self.vocab_start_index = vocab_start_index  # this TP rank's first vocabulary row
        self.sequence_parallel = sequence_parallel
        self._workspace = ChunkWorkspace()  # the fused loss's chunk buffers (CPU)

    def tied_slot(self, labels: torch.Tensor | None, device: torch.device) -> TiedGrad | None:
        """A slot for the fused loss's gradient of the tied weight, for the embedding lookup of
        the same forward to add its rows into (:mod:`~zerotron.kernels.tied_grad`); None where
        the loss is not the fused one or the lookup is compiled."""
        policy = kernel_policy(device)
        if labels is None or self.tp_group.size > 1:
            return None
        return TiedGrad() if policy.fused_loss and policy.eager_embedding else None

    def forward(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor | None = None,
        tied: TiedGrad | None = None,
    ) -> torch.Tensor:
        if self.tp_group.size > 1:
            return self._parallel(x, weight, labels)
        if labels is None:
            return self.logits(x, weight)
        if kernel_policy(x.device).fused_loss:
            return _fused_loss(x, weight, labels, self.orig_vocab_size, self._workspace, tied)
        real = weight[: self.orig_vocab_size]
        logits = F.linear(x, real).float()
        loss = F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction="none")
        return loss.view(labels.shape)

    def logits(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """All logits (TP=1), ``-inf`` for padded ids."""
        pad = self.vocab_size - self.orig_vocab_size
        logits = F.linear(x, weight[: self.orig_vocab_size] if pad else weight)
        return F.pad(logits, (0, pad), value=-math.inf) if pad else logits

    def _parallel(
        self, x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor | None
    ) -> torch.Tensor:
        """This rank's vocabulary rows, then the vocab-parallel loss or all logits.

        Padded ids (``>= orig_vocab_size``, on the last rank(s)) get ``-inf`` logits: no
        probability in the loss or in sampling, and zero gradient.
        """
        g = self.tp_group
        if self.sequence_parallel:  # [b, s/tp, h] -> [b, s, h]; backward reduce-scatters
            x = gather_from_sequence_parallel_region(x, g)
        else:  # backward sums the ranks' partial input gradients
            x = copy_to_tensor_model_parallel_region(x, g)
        logits = F.linear(x, weight)  # [b, s, vocab_size / tp]
        real = self.orig_vocab_size - self.vocab_start_index  # real ids in this shard
        if real < logits.shape[-1]:
            logits[..., max(real, 0) :] = -math.inf
        if labels is not None:
            return vocab_parallel_cross_entropy(logits, labels, g)
        return gather_from_tensor_model_parallel_region(logits, g)


@torch.compiler.disable
def _fused_loss(x, weight, labels, vocab_size, workspace, tied=None) -> torch.Tensor:
    """The fused loss, eager even inside ``torch.compile`` (the compiled graph stops before it):
    on the CPU it beats inductor's compiled ``F.cross_entropy`` over full logits (the chunk loop
    would only be unrolled into the graph, and inductor's fresh ``[tokens, vocab]`` buffers
    page-fault; bench/README.md). Only the CPU's kernel policy takes this path."""
    return fused_linear_cross_entropy(x, weight, labels, vocab_size, workspace=workspace, tied=tied)
