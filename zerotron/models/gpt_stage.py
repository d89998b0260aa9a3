"""A GPT pipeline stage: the part of a full GPT that one (virtual) pipeline stage runs.

:func:`build_gpt_stages` cuts a GPT into the model chunks of pipeline rank ``pp_rank``: one
:class:`GPTStage` per virtual stage (one without the interleaved schedule). Model chunk ``c`` of
stage ``s`` is virtual stage ``c * p + s`` (see
:func:`~zerotron.pipeline.schedules.virtual_stage`) and holds

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
the gradient of its own use. Both stages declare the weight tied over the embedding group (first
and last stage, :meth:`GPTStage.tied_weights`), and
:func:`~zerotron.parallel.declarations.allreduce_tied_grads` sums the two before the optimizer
step, so both copies receive the gradient of the tied weight and stay equal under any
deterministic optimizer.

A stage is called as ``stage(hidden, batch)`` (the runtime's chunk protocol, see
:mod:`~zerotron.pipeline.runtime`): ``hidden`` is the received activation ``[b, s, h]``
(None on virtual stage 0, which reads ``batch["tokens"]`` and ``batch.get("position_ids")``);
``batch.get("attention_mask")`` goes to every layer; the last virtual stage returns the per-token
loss ``[b, s]`` when ``batch`` has ``"labels"``, else the logits.

The last stage's output layer and loss are the GPT's own :class:`~zerotron.models.lm_head.LMHead`
(without the fused loss's in-place tied gradient: the lookup sits on another stage, or with one
stage, the gradients are summed by autograd as in every stage layout).

Tensor parallelism inside a stage: the chunks keep the GPT's TP layers; the last stage's copy of
the word embedding is this TP rank's vocabulary shard, and the output layer is GPT's vocab-parallel
one (under sequence parallelism the activations passed between stages are ``[b, s/tp, h]``).

Activation recompute: selective recompute lives in the layers, so stages have it as the GPT
does; full recompute (``recompute_granularity="full"``) checkpoints the chunk's own layers with
the GPT's :func:`~zerotron.models.gpt.run_layers_recomputed`, its ``recompute_num_layers``
counted per chunk, as Megatron counts them per pipeline stage.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from zerotron.distributed.state import state
from zerotron.errors import ConfigError
from zerotron.models.gpt import GPT, run_layers_recomputed
from zerotron.parallel.declarations import TiedWeight
from zerotron.pipeline.partition import (
    partition_balanced,
    partition_uniform,
    stage_layers,
)

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
            self.lm_head = model.lm_head
            if not pre_process:
                # Under TP each rank's copy holds its vocabulary rows, like the embedding's shard.
                self.output_layer = _TiedCopy(model.embedding.word_embeddings.weight)

    def word_embeddings_weight(self) -> nn.Parameter:
        """The word-embedding matrix this stage uses (its own copy on a last stage)."""
        if self.pre_process:
            return self.embedding.word_embeddings.weight
        return self.output_layer.weight

    def external_parameters(self) -> list[nn.Parameter]:
        """The output layer reads the word embedding (or its copy) outside the module owning it
        (see :mod:`zerotron.parallel.declarations`)."""
        return [self.word_embeddings_weight()] if self.post_process else []

    def tied_weights(self) -> list[TiedWeight]:
        """The first and the last stage hold the word embedding: tied over the embedding group."""
        if not (self.pre_process or self.post_process):
            return []
        return [TiedWeight(self.word_embeddings_weight(), state().embedding)]

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
        layers = list(self.layers.values())
        if torch.is_grad_enabled() and self.config.recompute_granularity == "full":
            tp = self.tp_group.size if self.tp_group is not None else 1
            x = run_layers_recomputed(layers, x, mask, mask is None, self.config, tp)
        else:
            for layer in layers:
                x = layer(x, mask, mask is None, None)
        if not self.post_process:
            return x
        x = self.final_layernorm(x)
        return self.lm_head(x, self.word_embeddings_weight(), batch.get("labels"))


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
    """Layer boundaries of the p·v parts (see :mod:`~zerotron.pipeline.partition`).

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
