"""Build what a GPT run needs from a validated Config: tokenizer, model, and its Engine.

Shared by ``zerotron pretrain`` and the tests and benchmarks that want the same objects. What
is GPT- and loop-specific lives here (seeding, the model, its loss, pipeline stages, checkpoint
metadata and vocabulary padding); the Engine itself is assembled by
:func:`zerotron.engine.builder.build_engine`.

Under pipeline parallelism every rank builds the full GPT from the same seed (so every layout
starts from the one-process weights), cuts out its stage's chunks
(:func:`~zerotron.models.gpt_stage.build_gpt_stages`), and gives the Engine a
:class:`StageModel` (those chunks under the GPT's own parameter names: the optimizer,
data-parallel buckets and checkpoints see one module) and a
:class:`~zerotron.pipeline.PipelineRuntime` running them.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from zerotron.checkpoint import build_metadata
from zerotron.checkpoint.async_save import AsyncCheckpointWriter
from zerotron.checkpoint.fit import VocabPadding
from zerotron.config import Config
from zerotron.data.tokenizer import (
    GPT2BPETokenizer,
    NullTokenizer,
    build_tokenizer,
    vocab_size_with_padding,
)
from zerotron.distributed.rng import model_parallel_seed
from zerotron.distributed.state import ParallelState, state
from zerotron.engine import Engine
from zerotron.engine.builder import (
    DTYPES,
    OptimizerSetup,
    build_engine,
    build_scheduler,
    build_torch_optimizer,
    default_device,
)
from zerotron.engine.monitors import MonitorMaster
from zerotron.models.gpt import GPT, VOCAB_PADDED_KEYS, GPTConfig
from zerotron.models.gpt_stage import TIED_COPY, GPTStage, build_gpt_stages
from zerotron.optim import get_param_groups
from zerotron.parallel import recompute
from zerotron.pipeline import PipelineRuntime


def set_random_seed(seed: int, ps: ParallelState | None = None) -> int:
    """Seed python, numpy and torch as Megatron's ``_set_random_seed``; return the seed used.

    Each pipeline stage draws from ``seed + 100 * pp_rank`` (its layers differ from the other
    stages'); every tensor- and data-parallel rank of a stage uses the same default stream. The
    tensor-parallel stream (dropout inside TP regions) is ``seed + 2718 + tp_rank`` of that.
    """
    ps = ps or state()
    seed = seed + 100 * ps.pp_rank
    _seed_all(seed)
    return seed


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_seed(seed)


def gpt_config(cfg: Config, padded_vocab_size: int, orig_vocab_size: int) -> GPTConfig:
    m = cfg.model
    return GPTConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        ffn_hidden_size=m.ffn_hidden_size,
        seq_length=m.seq_length,
        max_position_embeddings=m.max_position_embeddings,
        vocab_size=padded_vocab_size,
        orig_vocab_size=orig_vocab_size,
        layernorm_epsilon=m.layernorm_epsilon,
        init_method_std=m.init_method_std,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        recompute_granularity=m.recompute_granularity,
        recompute_method=m.recompute_method if m.recompute_granularity == "full" else None,
        recompute_num_layers=m.recompute_num_layers if m.recompute_granularity == "full" else None,
        sequence_parallel=cfg.parallel.sequence_parallel,
    )


def lr_increment(cfg: Config, global_batch_size: int) -> int:
    """What a step of ``global_batch_size`` samples advances the LR scheduler by: Megatron's
    schedule counts samples, DeepSpeed's (``lr_scheduler_type``) iterations."""
    return 1 if cfg.scheduler.lr_scheduler_type else global_batch_size


def lm_loss(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Megatron's GPT loss: per-token cross entropy averaged over the loss mask."""
    losses = model(
        batch["tokens"],
        batch["position_ids"],
        batch.get("attention_mask"),
        labels=batch["labels"],
    )
    mask = batch["loss_mask"].float()
    return (losses.float() * mask).sum() / mask.sum().clamp(min=1.0)


class StageModel(nn.Module):
    """This rank's pipeline chunks as one module, under the full GPT's parameter names.

    It registers the chunks' own submodules (no copies) as a GPT does: ``embedding`` (first
    stage), ``layers.<global index>``, ``final_layernorm`` and ``output_layer`` (the tied
    embedding's copy, last stage). So ``state_dict`` keys match the GPT's, and each parameter
    appears once. The chunks themselves, in order, are :attr:`chunks`; the runtime calls them.
    """

    def __init__(self, chunks: list[GPTStage]):
        super().__init__()
        self.chunks = list(chunks)  # a plain list: their modules are registered below
        self.config = chunks[0].config
        layers = nn.ModuleDict()
        for chunk in chunks:
            if chunk.pre_process:
                self.embedding = chunk.embedding
            for index, layer in chunk.layers.items():
                layers[index] = layer
            if chunk.post_process:
                self.final_layernorm = chunk.final_layernorm
                if not chunk.pre_process:
                    self.output_layer = chunk.output_layer
        self.layers = layers

    def num_parameters(self) -> int:
        """Parameters on this rank (the last stage counts its tied-embedding copy, as Megatron)."""
        return sum(p.numel() for p in self.parameters())


def flops_parameters(model: GPT) -> int:
    """The parameter count the model-FLOPs formula wants: all but the position embedding."""
    return model.num_parameters() - model.embedding.position_embeddings.weight.numel()


@dataclass
class Run:
    """Everything built for one training run.

    ``model`` is the GPT, or under pipeline parallelism this rank's :class:`StageModel`;
    ``flops_params`` is the full GPT's count for the throughput log (this TP rank's shards).
    """

    cfg: Config
    tokenizer: GPT2BPETokenizer | NullTokenizer
    model: GPT | StageModel
    engine: Engine
    flops_params: int = 0


def _pipeline(cfg: Config, model: GPT, ps: ParallelState) -> tuple[StageModel, PipelineRuntime]:
    """Cut ``model`` into this rank's chunks; the runtime that runs them on the schedule."""
    par = cfg.parallel
    chunks = build_gpt_stages(
        model,
        ps.pp_rank,
        ps.pp_size,
        par.virtual_pipeline_model_parallel_size or 1,
        "uniform",  # as Megatron: the config checks that the layers divide evenly
    )
    stage_model = StageModel(chunks)
    tied = getattr(stage_model, "output_layer", None)
    if tied is not None:
        # The first stage owns the tied embedding: the gradient norm counts it there only.
        tied.weight.shared = True
    runtime = PipelineRuntime(
        chunks,
        par.pipeline_schedule,
        cfg.training.num_micro_batches,
        variable_seq_lengths=par.variable_seq_lengths,
    )
    return stage_model, runtime


def _activation_checkpointing(cfg: Config) -> None:
    """DeepSpeed's activation checkpointing options (its config's ``activation_checkpointing``
    section, or Megatron-DeepSpeed's ``--partition-activations``, ``--checkpoint-in-cpu``, ...)
    for the GPT's full recompute, which then runs DeepSpeed's CheckpointFunction
    (:mod:`zerotron.parallel.recompute`); without any, torch's checkpoint. Module state, as in
    DeepSpeed: set for every run."""
    a = cfg.activation_checkpointing
    options = recompute.CheckpointingConfig(
        partition_activations=a.partition_activations,
        contiguous_checkpointing=a.contiguous_memory_optimization,
        checkpoint_in_cpu=a.cpu_checkpointing,
        synchronize=a.synchronize_checkpoint_boundary,
        profile=a.checkpointing_profile,
    )
    if options == recompute.CheckpointingConfig():
        recompute.reset(configuration=True)
        return
    # Megatron-DeepSpeed bounds the contiguous buffers by the layer count, as here
    checkpoints = a.number_checkpoints or cfg.model.num_layers
    recompute.set_config(dataclasses.replace(options, num_checkpoints=checkpoints))


def build_run(cfg: Config, *, timers: Any = None, device: torch.device | None = None) -> Run:
    """Tokenizer, model (seeded, in the training dtype, on ``device``), optimizer, Engine."""
    device = device or default_device()
    d = cfg.data
    tokenizer = build_tokenizer(
        d.tokenizer_type, d.vocab_file, d.merge_file, vocab_size=d.vocab_size
    )
    padded = vocab_size_with_padding(
        tokenizer.vocab_size,
        cfg.model.make_vocab_size_divisible_by,
        cfg.parallel.tensor_model_parallel_size,
    )
    ps = state()
    _activation_checkpointing(cfg)
    gcfg = gpt_config(cfg, padded, tokenizer.vocab_size)
    dtype = DTYPES[cfg.precision.params_dtype]
    pipeline = None
    if ps.pp_size == 1:
        set_random_seed(cfg.training.seed, ps)
        model = GPT(gcfg).to(device=device, dtype=dtype)
        flops_params = flops_parameters(model)
    else:
        # Every stage draws the whole GPT from the one seed, then keeps its part and moves to
        # its own stage's stream (Megatron's seed + 100 * pp_rank) for what training draws.
        _seed_all(cfg.training.seed)
        full = GPT(gcfg).to(device=device, dtype=dtype)
        flops_params = flops_parameters(full)
        model, pipeline = _pipeline(cfg, full, ps)
        del full  # what no chunk holds is freed
        set_random_seed(cfg.training.seed, ps)
    t = cfg.training
    # --train-iters 0 only builds and prints: a schedule over 0 steps is not one to build.
    scheduler = None if t.train_iters == 0 else (lambda opt: build_scheduler(cfg, opt))
    metadata = build_metadata(
        model_config=gcfg.to_dict(),
        vocab_size=tokenizer.vocab_size,
        padded_vocab_size=padded,
        tensor_model_parallel_size=cfg.parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=cfg.parallel.pipeline_model_parallel_size,
        data_parallel_size=cfg.parallel.data_parallel_size,
        tokenizer={
            "type": d.tokenizer_type,
            "vocab_file": d.vocab_file,
            "merge_file": d.merge_file,
            **({"vocab_size": d.vocab_size} if d.vocab_size is not None else {}),
        },
        params_dtype=cfg.precision.params_dtype,
    )
    # Groups before ZeRO stage 3 partitions the parameters (the rule looks at their shapes).
    groups = get_param_groups(model, cfg.optimizer.weight_decay)
    engine = build_engine(
        model,
        build_torch_optimizer(groups, cfg),
        OptimizerSetup.from_config(cfg),
        ps=ps,
        scheduler=scheduler,
        loss_fn=lm_loss,
        micro_batch_size=t.micro_batch_size,
        gradient_accumulation_steps=t.num_micro_batches,
        data_parallel_size=cfg.parallel.data_parallel_size,
        lr_increment=lr_increment(cfg, t.global_batch_size),
        checkpoint_metadata=metadata,
        state_fitter=VocabPadding(
            keys=(*VOCAB_PADDED_KEYS, TIED_COPY),
            vocab_size=tokenizer.vocab_size,
            padded_size=padded,
        ),
        compile=cfg.model.compile,
        timers=timers,
        pipeline=pipeline,
        autotuning=cfg.autotuning,
        flops_profiler=cfg.flops_profiler,
        monitor=MonitorMaster.from_config(cfg.monitor),
        profile_steps=cfg.monitor.profile_steps,
        profile_dir=cfg.monitor.profile_dir or cfg.training.metrics_dir or cfg.checkpoint.save,
    )
    _checkpoint_options(engine, cfg)
    return Run(cfg, tokenizer, model, engine, flops_params)


def _checkpoint_options(engine: Engine, cfg: Config) -> None:
    """--save-keep-last and --async-save, read by the Engine's save; the layout entries that
    ``zerotron checkpoint info`` reports beside the sizes (virtual stages, offload)."""
    c = cfg.checkpoint
    engine.checkpoint_keep_last = c.save_keep_last
    engine.checkpoint_writer = AsyncCheckpointWriter() if c.async_save else None
    engine.checkpoint_metadata.setdefault("layout", {}).update(
        virtual_pipeline_model_parallel_size=cfg.parallel.virtual_pipeline_model_parallel_size or 1,
        offload_optimizer_device=cfg.zero.offload_optimizer_device,
        offload_param_device=cfg.zero.offload_param_device,
    )
