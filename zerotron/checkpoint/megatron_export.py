"""Megatron-LM GPT checkpoints out: a zerotron checkpoint written as megatron-core (``mcore``),
legacy or ``torch_dist`` files for a tensor/pipeline-parallel layout (or as Megatron-DeepSpeed's,
:mod:`~zerotron.checkpoint.megatron_deepspeed_export`).

The names, QKV order and what each layout holds are described in
:mod:`zerotron.checkpoint.megatron` (the import side, whose name maps are reused here).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from zerotron.checkpoint import megatron_deepspeed_export as mds
from zerotron.checkpoint import megatron_io as mio
from zerotron.checkpoint.canonical import open_checkpoint
from zerotron.checkpoint.megatron import (
    CHECKPOINT_VERSION,
    FORMATS,
    MCORE_LAYER,
    MCORE_LINEARS,
    TE_FUSED,
    State,
)
from zerotron.checkpoint.reshard import (
    TIED_COPY,
    load_merged_state,
    load_shared_entries,
    orig_vocab_size_of,
    split_model_state,
    stage_layer_indices,
    target_padded_vocab_size,
)
from zerotron.errors import CheckpointError, ConfigError
from zerotron.fileio import atomic_dir, atomic_write_text, commit_dir
from zerotron.models.gpt import GPTConfig


def args_from_config(
    config: GPTConfig,
    padded: int,
    tp: int,
    pp: int,
    iteration: int,
    divisible_by: int,
    tokenizer: Mapping[str, Any] | None = None,
) -> argparse.Namespace:
    """The ``args`` Megatron-LM saves, for ``--use-checkpoint-args`` and for converters."""
    tokenizer = tokenizer or {}
    return argparse.Namespace(
        tokenizer_type=tokenizer.get("type"),
        vocab_file=tokenizer.get("vocab_file"),
        merge_file=tokenizer.get("merge_file"),
        vocab_size=tokenizer.get("vocab_size"),
        orig_vocab_size=config.orig_vocab_size,
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        ffn_hidden_size=config.ffn_hidden_size,
        num_attention_heads=config.num_attention_heads,
        kv_channels=config.kv_channels,
        group_query_attention=False,
        num_query_groups=None,
        seq_length=config.seq_length,
        max_position_embeddings=config.max_position_embeddings,
        position_embedding_type="learned_absolute",
        normalization="LayerNorm",
        norm_epsilon=config.layernorm_epsilon,
        swiglu=False,
        openai_gelu=True,
        bias_gelu_fusion=True,
        add_bias_linear=True,
        untie_embeddings_and_output_weights=False,
        apply_residual_connection_post_layernorm=False,
        padded_vocab_size=padded,
        make_vocab_size_divisible_by=divisible_by,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        hidden_dropout=config.hidden_dropout,
        attention_dropout=config.attention_dropout,
        init_method_std=config.init_method_std,
        iteration=iteration,
    )


def _mcore_name(key: str, local: int | None) -> str:
    if key.startswith("layers."):
        _, _, rest = key.split(".", 2)
        module, _, param = rest.rpartition(".")
        theirs = {v: k for k, v in MCORE_LAYER.items()}[module]
        return f"decoder.layers.{local}.{theirs}.{param}"
    if key.startswith("final_layernorm."):
        return "decoder." + key
    return key


def _legacy_tree(state: State, local_of: Mapping[int, int]) -> dict[str, Any]:
    theirs = {
        "input_layernorm": "input_norm",
        "self_attention.query_key_value": "self_attention.query_key_value",
        "self_attention.dense": "self_attention.dense",
        "post_attention_layernorm": "post_attention_norm",
        "mlp.dense_h_to_4h": "mlp.dense_h_to_4h",
        "mlp.dense_4h_to_h": "mlp.dense_4h_to_h",
    }
    lm: dict[str, Any] = {}
    tree: dict[str, Any] = {"language_model": lm}
    for key, t in state.items():
        if key.startswith("embedding."):
            _, part, param = key.split(".")
            lm.setdefault("embedding", {})[part] = {param: t}
        elif key.startswith("layers."):
            _, i, rest = key.split(".", 2)
            module, _, param = rest.rpartition(".")
            enc = lm.setdefault("encoder", {})
            enc[f"layers.{local_of[int(i)]}.{theirs[module]}.{param}"] = t
        elif key.startswith("final_layernorm."):
            lm.setdefault("encoder", {})["final_norm." + key.split(".")[1]] = t
        elif key == TIED_COPY:
            tree["word_embeddings_for_head"] = {"weight": t}
    return tree


def export_megatron(
    load_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    fmt: str,
    tp: int = 1,
    pp: int = 1,
    *,
    tag: str | None = None,
    make_vocab_size_divisible_by: int = 128,
    qkv_order: str | None = None,
    zero_stage: int | None = None,
    data_parallel: int = 1,
) -> Path:
    """Write ``load_dir``'s checkpoint as Megatron-LM's (``fmt`` one of :data:`FORMATS`) or
    Megatron-DeepSpeed's (``fmt`` "megatron-deepspeed", with the ``qkv_order`` of the version
    that will load it, one of :data:`~zerotron.checkpoint.megatron_deepspeed_export.QKV_ORDERS`)
    for a (``tp``, ``pp``) run into ``out_dir``; returns the iteration directory written.

    The vocabulary keeps the source's padding when it splits over ``tp``, else is padded as
    Megatron pads (``make_vocab_size_divisible_by × tp``). Files hold ``args``,
    ``checkpoint_version``, ``iteration`` and the model, no optimizer or RNG state: load them in
    Megatron-LM with ``--finetune`` (or ``--no-load-optim --no-load-rng``). ``zero_stage`` (1
    or 2; Megatron-DeepSpeed only): the training state too, as DeepSpeed's ZeRO optimizer of a
    run with ``data_parallel`` data-parallel ranks saves it
    (:mod:`~zerotron.checkpoint.megatron_deepspeed_export`).
    """
    if fmt not in (*FORMATS, mds.FORMAT):
        raise ConfigError(
            f"unknown Megatron format {fmt!r}",
            where="--megatron-format",
            fix=f"use one of {', '.join((*FORMATS, mds.FORMAT))}",
        )
    if fmt == mds.FORMAT:
        qkv_order = mds.check_qkv_order(qkv_order)
    if zero_stage == 2 and pp > 1:
        raise ConfigError(
            "--target-zero-stage 2 with --target-pipeline-parallel-size > 1: DeepSpeed's "
            "pipeline engine runs ZeRO stage 0 or 1",
            where="--target-zero-stage",
            fix="export --target-zero-stage 1 for a pipeline-parallel run",
        )
    if zero_stage is not None and (fmt != mds.FORMAT or zero_stage not in (1, 2)):
        raise ConfigError(
            f"--target-zero-stage {zero_stage} with --megatron-format {fmt}: the training state "
            "is written for Megatron-DeepSpeed under DeepSpeed's ZeRO stage 1 or 2 only",
            where="--target-zero-stage",
            fix="drop it to export the weights (load them with --finetune), or export "
            "--megatron-format megatron-deepspeed --target-zero-stage 1 for a ZeRO-1 run",
        )
    full, meta = load_merged_state(load_dir, tag)
    if "model" not in meta:
        raise CheckpointError("metadata.json has no model config", where=os.fspath(load_dir))
    config = GPTConfig.from_dict(meta["model"])
    padded = config.vocab_size
    if padded % tp:
        padded = target_padded_vocab_size(meta, tp, make_vocab_size_divisible_by)
    iteration = int(meta.get("iteration") or 0)
    orig = orig_vocab_size_of(meta) or config.orig_vocab_size
    divisible_by = _divisible_by(orig, padded, tp, make_vocab_size_divisible_by)
    args = args_from_config(config, padded, tp, pp, iteration, divisible_by, meta.get("tokenizer"))
    common = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration}
    if fmt == mds.FORMAT:
        shared = load_shared_entries(load_dir, tag)
        consumed = int(shared.get("consumed_train_samples") or 0)
        args.consumed_train_samples = consumed
        args.consumed_valid_samples = int(shared.get("consumed_valid_samples") or 0)
        train = None
        if zero_stage is not None:
            train = _training_state(load_dir, tag, zero_stage, data_parallel)
            vars(args).update(train.adam)
        layout = (tp, pp, orig, padded)
        return _write_deepspeed(
            out_dir, full, config, args, layout, iteration, consumed, str(qkv_order), train
        )
    target = Path(out_dir) / mio.tag_name(iteration)
    if fmt == "torch_dist":
        whole = split_model_state(full, 0, 1, orig_vocab_size=orig, padded_vocab_size=padded)
        tensors, objects = _torch_dist_entries(whole, config.num_layers)
        mio.write_torch_dist(target, tensors, objects, common)
        mio.write_tracker(out_dir, iteration)
        return target

    def files():
        for p in range(pp):
            layers = stage_layer_indices(config.num_layers, p, pp)
            local_of = {g: i for i, g in enumerate(layers)}
            for t in range(tp):
                state = split_model_state(
                    full, t, tp, p, pp, orig_vocab_size=orig, padded_vocab_size=padded
                )
                if fmt == "legacy":
                    model = _legacy_tree(state, local_of)
                else:
                    model = {}
                    for key, value in state.items():
                        i = int(key.split(".")[1]) if key.startswith("layers.") else None
                        model[_mcore_name(key, local_of.get(i))] = value
                    for i in local_of.values():
                        for linear in MCORE_LINEARS:
                            model[f"decoder.layers.{i}.{linear}._extra_state"] = None
                    if p == pp - 1:
                        model["output_layer._extra_state"] = None
                rank = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "")
                yield rank, {**common, "model": model}

    mio.write_rank_files(target, files())
    mio.write_tracker(out_dir, iteration)
    return target


def _write_deepspeed(
    out_dir: str | os.PathLike,
    full: State,
    config: GPTConfig,
    args: argparse.Namespace,
    layout: tuple[int, int, int, int],
    iteration: int,
    consumed: int,
    qkv_order: str,
    train: mds.TrainingState | None = None,
) -> Path:
    """Megatron-DeepSpeed's ``global_stepN/`` (module docstring of
    :mod:`~zerotron.checkpoint.megatron_deepspeed_export`), written atomically, then its
    trackers."""
    tp, pp, orig, padded = layout
    heads = config.num_attention_heads // tp
    target = Path(out_dir) / mds.tag_name(iteration)
    ds_args = mds.deepspeed_args(args, qkv_order)

    def cut(state: State, t: int, p: int, stages: int) -> State:
        own = split_model_state(
            state, t, tp, p, stages, orig_vocab_size=orig, padded_vocab_size=padded
        )
        return mds.in_order(own, qkv_order, heads)

    with atomic_dir(target) as tmp:
        for t in range(tp):
            # the training state of tensor rank t, whole depth (each stage takes its part)
            kinds = {k: cut(v, t, 0, 1) for k, v in train.kinds.items()} if train else {}
            for p in range(pp):
                state = cut(full, t, p, pp)
                for name, tensors in mds.layer_files(state, config.num_layers, t):
                    torch.save(tensors, Path(tmp) / name)
                module = mds.legacy_module(state) if pp == 1 else None
                entries = mds.model_states(
                    ds_args, iteration, consumed, tp * pp, module, CHECKPOINT_VERSION
                )
                if train is not None:
                    layers = stage_layer_indices(config.num_layers, p, pp)
                    params = mds.pipe_parameters(p, pp, layers, config.num_layers)
                    groups = mds.param_groups(params, kinds["master"])
                    for name, obj in mds.zero_files(kinds, groups, p * tp + t, train):
                        torch.save(obj, Path(tmp) / name)
                    entries.update(
                        param_shapes=mds.param_shapes(groups, kinds["master"]),
                        dp_world_size=train.data_parallel,
                        ds_config={"zero_optimization": {"stage": train.zero_stage}},
                    )
                    entries["lr_scheduler"] = mds.scheduler_state(
                        train.scheduler, consumed, config.seq_length
                    )
                torch.save(entries, Path(tmp) / f"mp_rank_{p * tp + t:02d}_model_states.pt")
        commit_dir(tmp, target)
    atomic_write_text(Path(out_dir) / mds.TRACKER, target.name)
    mio.write_tracker(out_dir, iteration)
    return target


def _training_state(
    load_dir: str | os.PathLike, tag: str | None, zero_stage: int, data_parallel: int
) -> mds.TrainingState:
    """A zerotron checkpoint's fp32 masters, Adam moments and step, schedule and clipping, for
    a Megatron-DeepSpeed export with its training state."""
    with open_checkpoint(load_dir, tag) as ckpt:
        if not ckpt.has_optimizer or set(ckpt.state_keys) != {"exp_avg", "exp_avg_sq"}:
            raise CheckpointError(
                "the checkpoint holds no Adam state to export"
                + ("" if ckpt.has_optimizer else " (no optimizer state at all)"),
                where=ckpt.where,
                fix="drop --target-zero-stage to export the weights alone (load them with "
                "--finetune)",
            )
        kinds = {
            kind: {name: ckpt.tensor(name, kind) for name in ckpt.names}
            for kind in ("master", "exp_avg", "exp_avg_sq")
        }
        scheduler = ckpt.engine_entry("opt_param_scheduler")
        if scheduler is None:
            raise CheckpointError(
                "the checkpoint holds no learning-rate schedule, which Megatron-DeepSpeed loads "
                "with the optimizer state",
                where=ckpt.where,
                fix="resume it in zerotron and save again (its schedule comes along), or drop "
                "--target-zero-stage and load the weights with --finetune",
            )
        step = ckpt.step(ckpt.names[0])
        group = ckpt.group_settings(False)
        betas = group.get("betas", (0.9, 0.999))
        return mds.TrainingState(
            kinds=kinds,
            step=int(step.item() if isinstance(step, torch.Tensor) else step or 0),
            scheduler=scheduler,
            adam={
                "adam_beta1": float(betas[0]),
                "adam_beta2": float(betas[1]),
                "adam_eps": float(group.get("eps", 1e-8)),
                "weight_decay": float(group.get("weight_decay", 0.0)),
            },
            zero_stage=zero_stage,
            data_parallel=data_parallel,
            bf16=ckpt.dtypes[ckpt.names[0]] == torch.bfloat16,
        )


def _divisible_by(orig: int, padded: int, tp: int, preferred: int) -> int:
    """A ``--make-vocab-size-divisible-by`` with which Megatron pads ``orig`` to ``padded`` at
    ``tp`` (it recomputes the padding from the tokenizer): ``preferred`` if it does, else the
    largest power of two that does, else ``padded / tp``."""

    def pads(d: int) -> bool:
        return -(-orig // (d * tp)) * d * tp == padded

    if pads(preferred):
        return preferred
    d = 1 << ((padded // tp).bit_length() - 1)
    while d > 1 and not pads(d):
        d //= 2
    return d if pads(d) else padded // tp


def _torch_dist_entries(state: State, num_layers: int) -> tuple[State, dict[str, Any]]:
    """megatron-core's sharded keys: layers stacked on dim 0, fused LayerNorm names, and an
    ``_extra_state`` object per linear and layer (None, as the local spec has; megatron-core
    stores a ``ShardedObject`` as the list of its shards' data)."""
    fused = {v: k for k, v in TE_FUSED.items()}
    tensors: State = {}
    per_layer: dict[str, list[torch.Tensor]] = {}
    for key, t in state.items():
        if key.startswith("layers."):
            _, i, rest = key.split(".", 2)
            name = fused.get(rest) or _mcore_name(key, 0).split(".", 3)[3]
            per_layer.setdefault(f"decoder.layers.{name}", [None] * num_layers)[int(i)] = t
        else:
            tensors[_mcore_name(key, None)] = t
    for key, parts in per_layer.items():
        tensors[key] = torch.stack(parts)
    objects = {
        f"decoder.layers.{linear}._extra_state/shard_{i}_{num_layers}": [None]
        for linear in MCORE_LINEARS
        for i in range(num_layers)
    }
    return tensors, objects
