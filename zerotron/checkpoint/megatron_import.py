"""``zerotron convert --from-megatron``: a Megatron checkpoint written as a zerotron one (or,
for ``zerotron pretrain --load``, held in memory as one).

The weights of every format :func:`~zerotron.checkpoint.megatron.read_megatron` reads; and,
where a Megatron-DeepSpeed run left DeepSpeed's optimizer partitions
(:mod:`~zerotron.checkpoint.megatron_deepspeed_optim`), its training state too, so that
``zerotron pretrain --load`` resumes it on any layout: each parameter's fp32 master and Adam
moments (merged over tensor ranks as the weights are), Adam's step, the optimizer's
hyperparameters (betas, eps, weight decay), the learning-rate schedule's position, the
iteration, DeepSpeed's step counters and the consumed samples. Not carried: RNG streams (another
tool's), an fp16 run's loss scale (the resumed run starts a fresh dynamic scaler).
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import torch

from zerotron.checkpoint import megatron_io as mio
from zerotron.checkpoint.canonical import Layout
from zerotron.checkpoint.convert_layout import write_layout
from zerotron.checkpoint.in_memory import InMemoryCheckpoint
from zerotron.checkpoint.megatron import State, rank_states, read_megatron, read_megatron_as_ours
from zerotron.checkpoint.megatron_deepspeed import is_megatron_deepspeed
from zerotron.checkpoint.megatron_deepspeed_optim import MegatronDeepSpeedOptimizer, read_optimizer
from zerotron.checkpoint.model import save_gpt
from zerotron.checkpoint.reshard import (
    WORD_EMBEDDING,
    merge_model_shards,
    target_padded_vocab_size,
)
from zerotron.errors import CheckpointError, UnsupportedError
from zerotron.optim import build_optimizer, get_param_groups

# Megatron's scheduler keys zerotron's OptimizerParamScheduler takes (optim/lr_schedule.py).
SCHEDULER_KEYS = (
    "max_lr",
    "lr_warmup_steps",
    "num_steps",
    "lr_decay_style",
    "lr_decay_steps",
    "min_lr",
    "start_wd",
    "end_wd",
    "wd_incr_style",
    "wd_incr_steps",
)
# Megatron-DeepSpeed's token-based lengths (--lr-warmup-tokens, --lr-decay-tokens) and the
# scheduler keys (in samples) they stand for.
TOKEN_SCHEDULE_KEYS = {"lr_warmup_tokens": "lr_warmup_steps", "lr_decay_tokens": "lr_decay_steps"}


def import_megatron(
    path: str | os.PathLike,
    save_dir: str | os.PathLike,
    tag: str | None = None,
    target: Layout | None = None,
    make_vocab_size_divisible_by: int = 128,
) -> tuple[str, dict[str, Any]]:
    """Convert a Megatron checkpoint into a zerotron one; returns (its path, what was found:
    ``read_megatron``'s info, with ``optimizer`` True when the training state came along).

    ``target``: the layout to write (default: one process, ZeRO stage 0); its vocabulary rows,
    if not given, are the source's when they split over its tensor size, else padded to
    ``make_vocab_size_divisible_by`` x its tensor size.
    """
    optimizer = read_megatron_optimizer(path)
    if optimizer is None and target is None:  # weights alone, one process: Megatron's release
        config, state, info = read_megatron(path)
        iteration = info.get("iteration")
        out = save_gpt(
            save_dir,
            config,
            state,
            tag=tag or (f"iter_{int(iteration):07d}" if iteration else "release"),
            tokenizer=info.pop("tokenizer"),
            source=os.fspath(path),
            megatron=info,
        )
        return out, {**info, "optimizer": False}
    ckpt, info = _imported(path, tag, optimizer)
    target = target or Layout()
    if target.padded_vocab_size is None:
        rows = ckpt.shapes[WORD_EMBEDDING][0]
        if rows % target.tensor_parallel:
            rows = target_padded_vocab_size(
                ckpt.meta, target.tensor_parallel, make_vocab_size_divisible_by
            )
        target = replace(target, padded_vocab_size=rows)
    out = write_layout(ckpt, save_dir, target)
    return str(out), {**info, "optimizer": optimizer is not None}


def training_state(path: str | os.PathLike) -> tuple[InMemoryCheckpoint, dict[str, Any]] | None:
    """A Megatron-DeepSpeed checkpoint's weights and training state in memory, as an Engine
    loads them (:meth:`~zerotron.engine.core.Engine.load_imported`), and what was found; None
    where it has no optimizer partitions (see :func:`read_megatron_optimizer`)."""
    optimizer = read_megatron_optimizer(path)
    return None if optimizer is None else _imported(path, None, optimizer)


def read_megatron_optimizer(
    path: str | os.PathLike,
) -> tuple[dict[str, State], MegatronDeepSpeedOptimizer] | None:
    """A Megatron-DeepSpeed checkpoint's optimizer state as ours: (``{"master" | "exp_avg" |
    "exp_avg_sq": single-process state dict}``, what else was read); None where the checkpoint
    has no optimizer partitions (Megatron-LM's formats; Megatron-DeepSpeed at ZeRO stage 0 in
    fp32 or fp16, whose optimizer state inside the model-states files is not read)."""
    tag = mio.tag_dir(path)
    if mio.is_torch_dist(tag) or not is_megatron_deepspeed(tag):
        return None
    first = mio.load_safe(tag / mio.DEEPSPEED_MODEL_STATES, mmap=True)
    args = first["args"]
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    found = read_optimizer(tag, tp, pp)
    if found is None:
        return None
    heads = int(args.num_attention_heads)
    merged: dict[str, State] = {}
    for kind, ranks in found.states.items():
        files = {
            (t, 0): {
                "model": model,
                "args": args,
                "checkpoint_version": first.get("checkpoint_version"),
            }
            for t, model in ranks.items()
        }
        states, _, _ = rank_states(files, tp, 1, heads, tag)
        merged[kind] = merge_model_shards(states, tp, 1, where=str(tag))
    return merged, found


def _imported(
    path: str | os.PathLike,
    tag: str | None,
    optimizer: tuple[dict[str, State], MegatronDeepSpeedOptimizer] | None,
) -> tuple[InMemoryCheckpoint, dict[str, Any]]:
    """The Megatron checkpoint as an in-memory zerotron checkpoint (with its training state
    when ``optimizer``, a Megatron-DeepSpeed run's, is given), and what was found."""
    config, weights, meta, info = read_megatron_as_ours(path)
    source = mio.tag_dir(path)
    iteration = int(info.get("iteration") or 0)
    tag = tag or (f"iter_{iteration:07d}" if iteration else "release")
    meta = {**meta, "tokenizer": info.pop("tokenizer"), "source": os.fspath(path),
            "megatron": info}  # fmt: skip
    layout = Layout(
        tensor_parallel=int(info["tensor_parallel"]),
        pipeline_parallel=int(info["pipeline_parallel"]),
    )
    if optimizer is None:
        return InMemoryCheckpoint(root=source, tag=tag, meta=meta, layout=layout,
                                  weights=weights), info  # fmt: skip
    merged, found = optimizer
    first = mio.load_safe(source / mio.DEEPSPEED_MODEL_STATES, mmap=True)
    engine: dict[str, Any] = {
        "global_steps": int(first.get("global_steps") or iteration),
        "global_samples": int(first.get("global_samples") or info["consumed_train_samples"]),
    }
    scheduler = _scheduler(first.get("lr_scheduler"), config.seq_length)
    if scheduler is not None:
        engine["opt_param_scheduler"] = scheduler
    ckpt = InMemoryCheckpoint(
        root=source,
        tag=tag,
        meta=meta,
        layout=replace(layout, data_parallel=found.data_parallel, zero_stage=found.zero_stage),
        weights=weights,
        masters=merged["master"],
        moments={k: merged[k] for k in ("exp_avg", "exp_avg_sq")},
        # a 0-d fp32 tensor, as torch's Adam keeps it (apex's FusedAdam kept an int per group)
        step=torch.as_tensor(found.step, dtype=torch.float32).clone(),
        groups=_group_settings(found.param_groups or [_args_group(first["args"])], str(source)),
        client={
            "iteration": iteration,
            "consumed_train_samples": info["consumed_train_samples"],
            "consumed_valid_samples": info["consumed_valid_samples"],
        },
        engine=engine,
        extras={"num_skipped_steps": int(first.get("skipped_steps") or 0)},
    )
    return ckpt, info


def _group_settings(saved: list[dict[str, Any]], where: str) -> dict[bool, dict[str, Any]]:
    """The decayed and not-decayed groups as zerotron's AdamW saves them, with the saved run's
    hyperparameters (Megatron-DeepSpeed's groups may split further by learning-rate scale; their
    betas, eps and weight decay are the run's)."""
    if not saved:
        raise CheckpointError("the optimizer files hold no parameter groups", where=where)
    decayed = next((g for g in saved if float(g.get("weight_decay") or 0) > 0), saved[0])
    missing = [k for k in ("lr", "betas", "eps") if k not in decayed]
    if missing:
        raise UnsupportedError(
            f"the optimizer's parameter groups have no {', '.join(missing)} (not Adam's)",
            where=where,
            fix="only Adam's state converts",
        )
    wd = float(decayed.get("weight_decay") or 0.0)
    probe = [
        ("weight", torch.nn.Parameter(torch.zeros(1, 1))),
        ("bias", torch.nn.Parameter(torch.zeros(1))),
    ]
    ours = build_optimizer(
        get_param_groups(probe, wd),
        "adamw",
        lr=float(decayed["lr"]),
        betas=tuple(float(b) for b in decayed["betas"]),
        eps=float(decayed["eps"]),
        weight_decay=wd,
    )
    return {
        not g["wd_mult"]: {k: v for k, v in g.items() if k != "params"}
        for g in ours.state_dict()["param_groups"]
    }


def _args_group(args: Any) -> dict[str, Any]:
    """The optimizer's settings from Megatron's flags (for files whose optimizer state keeps no
    param groups: DeepSpeed's elastic form)."""
    return {
        "lr": float(getattr(args, "lr", 0.0) or 0.0),
        "betas": (float(args.adam_beta1), float(args.adam_beta2)),
        "eps": float(args.adam_eps),
        "weight_decay": float(args.weight_decay),
    }


def _scheduler(saved: Any, seq_length: int) -> dict[str, Any] | None:
    """Megatron's scheduler state in the keys zerotron's scheduler takes (None: none saved).
    Megatron-DeepSpeed's token-based lengths become ``tokens / seq_length`` samples, as
    zerotron's config turns ``--lr-decay-tokens`` / ``--lr-warmup-tokens`` into samples
    (:mod:`zerotron.config.token_schedule`), so a run given the same flags matches them."""
    if not isinstance(saved, dict):
        return None
    out = {k: saved[k] for k in SCHEDULER_KEYS if k in saved}
    for tokens, samples in TOKEN_SCHEDULE_KEYS.items():
        if saved.get(tokens) is not None:
            out[samples] = saved[tokens] / seq_length
    return out


def describe_import(info: dict[str, Any]) -> str:
    """What ``zerotron convert --from-megatron`` carried, in a line."""
    if info.get("optimizer"):
        return "weights and training state (fp32 masters, Adam moments and step, schedule)"
    return "weights only"
