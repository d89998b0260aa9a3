"""A GPT pipeline stage: the part of a full GPT that one (virtual) pipeline stage runs.

:func:`build_gpt_stages` cuts a GPT into the model chunks of pipeline rank ``pp_rank``: one
:class:`GPTStage` per virtual stage (one without the interleaved schedule). Model chunk ``c`` of
stage ``s`` is virtual stage ``c * p + s`` (see
:func:`~zerotron.parallel.pipeline.schedules.virtual_stage`) and holds

- the embedding (word + position) when it is virtual stage 0,
- its slice of the transformer layers (uniform, or balanced by parameter count),
- the final LayerNorm and the output layer when it is the last virtual stage.

Every rank builds the *full* GPT with the same seed and keeps its part, so every layout starts
from the same weights as the single-process model (building only the stage's part, to save
memory and time on large models, is future work). Parameter names are the GPT's own
(``layers.5.mlp...`` keeps its global index), so gradients and checkpoints compare by name.

Tied embedding: the output layer multiplies by the word-embedding matrix. With one pipeline
stage that is the same parameter. With more, the last stage holds a copy, ``output_layer.weight``
(equal to the first stage's ``embedding.word_embeddings.weight`` at build time); each copy gets
the gradient of its own use, and :func:`allreduce_embedding_grads` sums the two over the
embedding group (first and last stage) before the optimizer step, so both copies receive the
gradient of the tied weight and stay equal under any deterministic optimizer.

A stage is called as ``stage(hidden, batch)`` (the runtime's chunk protocol, see
:mod:`~zerotron.parallel.pipeline.runtime`): ``hidden`` is the received activation ``[b, s, h]``
(None on virtual stage 0, which reads ``batch["tokens"]`` and ``batch.get("position_ids")``);
``batch.get("attention_mask")`` goes to every layer; the last virtual stage returns the per-token
loss ``[b, s]`` when ``batch`` has ``"labels"``, else the logits.

Tensor parallelism inside a stage: the chunks keep the GPT's TP layers; the last stage's copy of
the word embedding is this TP rank's vocabulary shard, and the output layer is GPT's vocab-parallel
one (under sequence parallelism the activations passed between stages are ``[b, s/tp, h]``).
Not yet: activation recompute (the stage runs its layers plainly).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from zerotron.distributed import comm
from zerotron.distributed.state import state
from zerotron.errors import ConfigError
from zerotron.parallel.tensor import (
    copy_to_tensor_model_parallel_region,
    fused_linear_cross_entropy,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    vocab_parallel_cross_entropy,
)
from zerotron.pipeline.partition import (
    partition_balanced,
    partition_uniform,
    stage_layers,
)
from zerotron.precision.grads import grad_of

if TYPE_CHECKING:  # models/ sits above parallel/: a GPT is only passed in, never imported
    from zerotron.models.gpt import GPT

PARTITION_METHODS = ("uniform", "parameters")
TIED_COPY = "output_layer.weight"  # the last stage's copy of embedding.word_embeddings.weight
WORD_EMBEDDING = "embedding.word_embeddings.weight"


class GPTStage(nn.Module):
    """One model chunk of a pipelined GPT (see the module docstring)."""

    def __init__(
        self,
        model: GPT,
        layers: range,
        *,
        pre_process: bool,
        post_process: bool,
    ):
        super().__init__()
        self.config = model.config
        self.layer_range = layers
        self.pre_process = pre_process  # holds the embedding (virtual stage 0)
        self.post_process = post_process  # holds the final LayerNorm and the output layer
        # The chunk takes the model's own modules (no copy): the rest is freed with the model.
        self.tp_group = getattr(model, "tp_group", None)
        self.sequence_parallel = getattr(model, "sequence_parallel", False)
        if pre_process:
            self.embedding = model.embedding
        # Keyed by the global layer index so parameter names match the full GPT's.
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layers})
        if post_process:
            self.final_layernorm = model.final_layernorm
            word = model.embedding.word_embeddings
            # Under TP each rank's copy holds its vocabulary rows, like the embedding's shard.
            self.vocab_start_index = getattr(word, "vocab_start_index", 0)
            if not pre_process:
                self.output_layer = _TiedCopy(word.weight)

    def word_embeddings_weight(self) -> nn.Parameter:
        """The word-embedding matrix this stage uses (its own copy on a last stage)."""
        if self.pre_process:
            return self.embedding.word_embeddings.weight
        return self.output_layer.weight

    def forward(self, hidden: torch.Tensor | None, batch: Mapping[str, Any]) -> torch.Tensor:
        mask = batch.get("attention_mask")
        if self.pre_process:
            x = self.embedding(batch["tokens"], batch.get("position_ids"))
        elif hidden is None:
            raise ConfigError(
                f"pipeline stage with layers {self.layer_range.start}.."
                f"{self.layer_range.stop - 1} got no input activation",
                where="GPTStage.forward",
                fix="only virtual stage 0 reads tokens; pass the received activation",
            )
        else:
            x = hidden
        for layer in self.layers.values():
            x = layer(x, mask, mask is None, None)
        if not self.post_process:
            return x
        return self._head(self.final_layernorm(x), batch.get("labels"))

    def _head(self, x: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        # GPT.forward's tied output layer, on this stage's copy of the word embedding: padded
        # vocabulary ids never get probability.
        cfg = self.config
        weight = self.word_embeddings_weight()
        g = self.tp_group
        if g is not None and g.size > 1:
            return self._parallel_head(x, weight, labels)
        if labels is not None:  # the loss GPT.forward computes: fused, in token chunks
            return fused_linear_cross_entropy(x, weight, labels, cfg.orig_vocab_size)
        if cfg.orig_vocab_size < cfg.vocab_size:
            weight = weight[: cfg.orig_vocab_size]
        logits = F.linear(x, weight)
        if cfg.orig_vocab_size < cfg.vocab_size:
            logits = F.pad(logits, (0, cfg.vocab_size - cfg.orig_vocab_size), value=-math.inf)
        return logits

    def _parallel_head(
        self, x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor | None
    ) -> torch.Tensor:
        """Tensor parallel: this rank's vocabulary rows, then vocab-parallel loss or logits."""
        g = self.tp_group
        if self.sequence_parallel:  # [b, s/tp, h] -> [b, s, h]; backward reduce-scatters
            x = gather_from_sequence_parallel_region(x, g)
        else:  # backward sums the ranks' partial input gradients
            x = copy_to_tensor_model_parallel_region(x, g)
        logits = F.linear(x, weight)  # [b, s, vocab_size / tp]
        real = self.config.orig_vocab_size - self.vocab_start_index  # real ids in this shard
        if real < logits.shape[-1]:
            logits[..., max(real, 0) :] = -math.inf
        if labels is not None:
            return vocab_parallel_cross_entropy(logits, labels, g)
        return gather_from_tensor_model_parallel_region(logits, g)


class _TiedCopy(nn.Module):
    """The last stage's copy of the word embedding, used only by the output layer."""

    def __init__(self, word_embeddings: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(word_embeddings.detach().clone())
        for attr in ("tensor_model_parallel", "partition_dim", "partition_stride"):
            if hasattr(word_embeddings, attr):  # the same TP split as the embedding's shard
                setattr(self.weight, attr, getattr(word_embeddings, attr))


def layer_boundaries(
    model: GPT, pp_size: int, virtual_stages: int = 1, method: str = "uniform"
) -> list[int]:
    """Layer boundaries of the p·v parts (see :mod:`~zerotron.parallel.pipeline.partition`).

    ``"uniform"``: equal layer counts. ``"parameters"``: balanced by parameter count, where the
    first layer also carries the embedding's parameters and the last layer the final LayerNorm
    and the tied output-layer copy (the stages that hold them pay for them).
    """
    if method not in PARTITION_METHODS:
        raise ConfigError(
            f"unknown pipeline partition method {method!r}",
            where="partition_method",
            fix=f"use one of {', '.join(PARTITION_METHODS)}",
        )
    n = model.config.num_layers
    if method == "uniform":
        return partition_uniform(n, pp_size, virtual_stages)
    weights = [float(sum(p.numel() for p in layer.parameters())) for layer in model.layers]
    weights[0] += sum(p.numel() for p in model.embedding.parameters())
    weights[-1] += sum(p.numel() for p in model.final_layernorm.parameters())
    if pp_size * virtual_stages > 1:
        weights[-1] += model.embedding.word_embeddings.weight.numel()
    return partition_balanced(weights, pp_size, virtual_stages)


def build_gpt_stages(
    model: GPT,
    pp_rank: int,
    pp_size: int,
    virtual_stages: int = 1,
    partition_method: str = "uniform",
) -> list[GPTStage]:
    """The model chunks of pipeline rank ``pp_rank``, chunk 0 first.

    ``model`` is the full GPT, built with the same seed on every rank (after
    ``initialize_model_parallel``, so its layers are this TP rank's shards). The chunks take its
    modules (no copy); drop the model afterwards and the parts no chunk holds are freed.
    """
    if not 0 <= pp_rank < pp_size:
        raise ConfigError(
            f"pipeline rank {pp_rank} is outside 0..{pp_size - 1}", where="build_gpt_stages"
        )
    bounds = layer_boundaries(model, pp_size, virtual_stages, partition_method)
    last = pp_size * virtual_stages - 1
    stages = []
    for chunk in range(virtual_stages):
        vstage = chunk * pp_size + pp_rank
        stages.append(
            GPTStage(
                model,
                stage_layers(bounds, pp_rank, pp_size, chunk),
                pre_process=vstage == 0,
                post_process=vstage == last,
            )
        )
    return stages


def allreduce_embedding_grads(stage_modules: Sequence[nn.Module]) -> None:
    """Sum the tied word embedding's gradients over the embedding group (first + last stage).

    Call after the pipeline's backward and before the optimizer step. A no-op on ranks outside
    the group (middle stages) and with one pipeline stage (the weight is a single parameter).
    A copy that got no gradient this step contributes zeros. The gradient is the parameter's
    ``main_grad`` where it has one (data-parallel buffers, 16-bit params), else ``.grad``.
    """
    group = state().embedding
    if not group.is_member or group.size == 1:
        return
    weights = [
        m.word_embeddings_weight()
        for m in stage_modules
        if isinstance(m, GPTStage) and (m.pre_process or m.post_process)
    ]
    if len(weights) != 1:
        raise ConfigError(
            f"expected one stage holding the word embedding on this rank, found {len(weights)}",
            where="allreduce_embedding_grads",
            fix="pass this rank's GPTStage chunks from build_gpt_stages",
        )
    weight = weights[0]
    grad = grad_of(weight)  # main_grad under data parallelism or 16-bit params, else .grad
    if grad is None:
        weight.grad = grad = torch.zeros_like(weight)
    comm.all_reduce(grad, group)
