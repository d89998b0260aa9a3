"""Build what a GPT run needs from a validated Config: tokenizer, model, optimizer, Engine.

Shared by ``zerotron pretrain`` and the tests and benchmarks that want the same objects.

Under pipeline parallelism every rank builds the full GPT from the same seed (so every layout
starts from the one-process weights), cuts out its stage's chunks
(:func:`~zerotron.models.gpt_stage.build_gpt_stages`), and gives the Engine a
:class:`StageModel` (those chunks under the GPT's own parameter names: the optimizer,
data-parallel buckets and checkpoints see one module) and a
:class:`~zerotron.parallel.pipeline.PipelineRuntime` running them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from zerotron.checkpoint import build_metadata
from zerotron.config import Config
from zerotron.data.tokenizer import GPT2BPETokenizer, build_tokenizer, vocab_size_with_padding
from zerotron.distributed.rng import model_parallel_seed
from zerotron.distributed.state import ParallelState, state
from zerotron.engine import Engine, grad_norm_hooks
from zerotron.models.gpt import GPT, VOCAB_PADDED_KEYS, GPTConfig
from zerotron.models.gpt_stage import TIED_COPY, GPTStage, build_gpt_stages
from zerotron.optim import (
    OptimizerParamScheduler,
    build_ds_scheduler,
    build_optimizer,
    get_param_groups,
)
from zerotron.parallel.data_parallel import DataParallel
from zerotron.parallel.pipeline import PipelineRuntime
from zerotron.precision import MixedPrecisionOptimizer, make_loss_scaler

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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


def default_device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else (torch.device("cpu"))
    )


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


def build_torch_optimizer(params: Any, cfg: Config) -> torch.optim.Optimizer:
    """The config's optimizer (``optimizer`` section) over ``params`` (tensors or groups)."""
    o = cfg.optimizer
    return build_optimizer(
        params,
        o.optimizer,
        lr=o.lr if o.lr is not None else 0.0,  # --train-iters 0 may leave it unset
        weight_decay=o.weight_decay,
        betas=(o.adam_beta1, o.adam_beta2),
        eps=o.adam_eps,
        momentum=o.sgd_momentum,
        nesterov=o.sgd_nesterov,
        adam_w_mode=o.adam_w_mode,
        max_coeff=o.lamb_max_coeff,
        min_coeff=o.lamb_min_coeff,
    )


def offload_options(cfg: Config, kind: str) -> Any:
    """``zero.offload_{kind}_*`` as :class:`~zerotron.zero.offload.OffloadOptions` (None: off)."""
    z = cfg.zero
    device = getattr(z, f"offload_{kind}_device")
    if device == "none":
        return None
    from zerotron.zero.offload import OffloadOptions

    return OffloadOptions(
        device=device,
        nvme_path=getattr(z, f"offload_{kind}_nvme_path"),
        pin_memory=getattr(z, f"offload_{kind}_pin_memory"),
        buffer_count=getattr(z, f"offload_{kind}_buffer_count"),
    )


COMM_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def wrap_optimizer(
    model: nn.Module, optimizer: torch.optim.Optimizer, cfg: Config, ps: ParallelState | None = None
) -> tuple[Any, Any]:
    """Master weights, loss scaling, clipping and the data-parallel reduction around a fresh
    torch ``optimizer`` over ``model``'s parameters (already in the training dtype).

    Returns ``(optimizer, data_parallel)`` for the Engine. ZeRO stage 0:
    a :class:`MixedPrecisionOptimizer` and a :class:`DataParallel` (None for one replica), the
    latter built first so the optimizer sees its ``main_grad`` buffers. Stages 1-3: a
    :class:`~zerotron.zero.ZeroOptimizer`, which is both (stage 3 partitions ``model``'s
    parameters first, with the offload_param store when asked).
    """
    ps = ps or state()
    z, p, o = cfg.zero, cfg.precision, cfg.optimizer
    dtype = DTYPES[p.params_dtype]
    scaler = make_loss_scaler(
        dtype,
        loss_scale=p.loss_scale,
        initial_scale=p.initial_loss_scale,
        scale_window=p.loss_scale_window,
        hysteresis=p.hysteresis,
        consecutive_hysteresis=p.consecutive_hysteresis,
        min_scale=p.min_loss_scale,
        raise_error_at_min_scale=False,  # Megatron keeps going at the minimum scale
    )
    reduce_fn, is_counted = grad_norm_hooks(ps)
    if z.zero_stage == 0:
        data_parallel = None
        if ps.dp_size > 1:
            data_parallel = DataParallel(
                model.parameters(),
                ps.dp,
                bucket_size=cfg.parallel.ddp_bucket_size,
                reduce_in_fp32=p.accumulate_allreduce_grads_in_fp32,
            )
        wrapped = MixedPrecisionOptimizer(
            optimizer,
            loss_scaler=scaler,
            clip_grad=o.clip_grad,
            reduce_fn=reduce_fn,
            is_counted=is_counted,
        )
        return wrapped, data_parallel
    from zerotron.zero import ZeroOptimizer

    if z.zero_stage == 3:
        from zerotron.zero.stage3 import partition_parameters

        store = None
        param_options = offload_options(cfg, "param")
        if param_options is not None:
            from zerotron.zero.offload import ParamStore

            store = ParamStore(param_options, rank_name=f"rank{ps.rank}")
        partition_parameters(
            model,
            ps.dp,
            persistence_threshold=z.stage3_param_persistence_threshold,
            prefetch_bucket_size=z.stage3_prefetch_bucket_size,
            max_live_parameters=z.stage3_max_live_parameters,
            param_store=store,
        )
    wrapped = ZeroOptimizer(
        model,
        optimizer,
        stage=z.zero_stage,
        group=ps.dp,
        loss_scaler=scaler,
        clip_grad=o.clip_grad,
        reduce_fn=reduce_fn,
        is_counted=is_counted,
        reduce_bucket_size=z.reduce_bucket_size,
        allgather_bucket_size=z.allgather_bucket_size,
        overlap_comm=bool(z.overlap_comm),
        reduce_scatter=z.reduce_scatter,
        contiguous_gradients=z.contiguous_gradients,
        round_robin_gradients=z.round_robin_gradients,
        offload_optimizer=offload_options(cfg, "optimizer"),
        offload_param=offload_options(cfg, "param"),
        sub_group_size=z.sub_group_size,
        prefetch_bucket_size=z.stage3_prefetch_bucket_size,
        param_persistence_threshold=z.stage3_param_persistence_threshold,
        max_live_parameters=z.stage3_max_live_parameters,
        max_reuse_distance=z.stage3_max_reuse_distance,
        gather_16bit_weights_on_model_save=z.stage3_gather_16bit_weights_on_model_save,
        communication_data_type=COMM_DTYPES.get(z.communication_data_type or ""),
        gradient_predivide_factor=z.gradient_predivide_factor,
        prescale_gradients=z.prescale_gradients,
    )
    return wrapped, wrapped


def build_scheduler(cfg: Config, optimizer: Any) -> Any:
    """The config's LR schedule over ``optimizer``: DeepSpeed's ``lr_scheduler_type`` (counted
    in iterations), else Megatron's warmup + decay (counted in samples) when the run has a
    length; None otherwise."""
    s, o = cfg.scheduler, cfg.optimizer
    if s.lr_scheduler_type is not None:
        return build_ds_scheduler(s.lr_scheduler_type, optimizer, s.lr_scheduler_params)
    if cfg.lr_decay_steps is None:
        return None
    return OptimizerParamScheduler(
        optimizer,
        max_lr=o.lr,
        min_lr=o.min_lr,
        lr_decay_steps=cfg.lr_decay_steps,
        lr_decay_style=s.lr_decay_style,
        lr_warmup_steps=cfg.lr_warmup_steps,
        init_lr=s.lr_warmup_init,
        start_wd=o.start_weight_decay,
        end_wd=o.end_weight_decay,
        wd_incr_steps=cfg.lr_decay_steps,
        wd_incr_style=o.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=s.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=s.override_opt_param_scheduler,
    )


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
    tokenizer: GPT2BPETokenizer
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
    runtime = PipelineRuntime(chunks, par.pipeline_schedule, cfg.training.num_micro_batches)
    return stage_model, runtime


def build_run(cfg: Config, *, timers: Any = None, device: torch.device | None = None) -> Run:
    """Tokenizer, model (seeded, in the training dtype, on ``device``), optimizer, Engine."""
    device = device or default_device()
    d = cfg.data
    tokenizer = build_tokenizer(d.tokenizer_type, d.vocab_file, d.merge_file)
    padded = vocab_size_with_padding(
        tokenizer.vocab_size,
        cfg.model.make_vocab_size_divisible_by,
        cfg.parallel.tensor_model_parallel_size,
    )
    ps = state()
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
    # Groups before ZeRO stage 3 partitions the parameters (the rule looks at their shapes).
    groups = get_param_groups(model, cfg.optimizer.weight_decay)
    optimizer, data_parallel = wrap_optimizer(model, build_torch_optimizer(groups, cfg), cfg, ps)
    scheduler = None
    # --train-iters 0 only builds and prints: a schedule over 0 steps is not one to build.
    if cfg.training.train_iters != 0:
        scheduler = build_scheduler(cfg, optimizer)
    t = cfg.training
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
        },
        params_dtype=cfg.precision.params_dtype,
    )
    engine = Engine(
        model,
        optimizer,
        scheduler,
        loss_fn=lm_loss,
        micro_batch_size=t.micro_batch_size,
        gradient_accumulation_steps=t.num_micro_batches,
        data_parallel_size=cfg.parallel.data_parallel_size,
        # Megatron's schedule counts samples, DeepSpeed's iterations
        lr_increment=1 if cfg.scheduler.lr_scheduler_type else t.global_batch_size,
        checkpoint_metadata=metadata,
        vocab_keys=(*VOCAB_PADDED_KEYS, TIED_COPY),
        orig_vocab_size=tokenizer.vocab_size,
        compile=cfg.model.compile,
        timers=timers,
        data_parallel=data_parallel,
        pipeline=pipeline,
    )
    return Run(cfg, tokenizer, model, engine, flops_params)
