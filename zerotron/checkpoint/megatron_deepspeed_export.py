"""Megatron-DeepSpeed checkpoints out: a zerotron model written as Megatron-DeepSpeed's
``pretrain_gpt.py`` saves through DeepSpeed, for a tensor/pipeline-parallel layout.

What goes into ``global_stepN/`` (the layout :mod:`zerotron.checkpoint.megatron_deepspeed`
reads):

- ``layer_LL-model_TT-model_states.pt`` per GPTModelPipe layer and tensor rank TT: LL 01 the
  embedding (``word_embeddings``, ``position_embeddings``), 02.. the transformer layers, then
  the final LayerNorm (the pipeline engine, Megatron-DeepSpeed's default, loads these whatever
  its pipeline size);
- ``mp_rank_MM_model_states.pt`` per model-parallel rank (MM = pipeline rank × TP + tensor
  rank): Megatron's ``args``, ``checkpoint_version`` 3.0, ``iteration`` and DeepSpeed's counters;
  at pipeline size 1 also ``module``, the legacy GPTModel state dict, which
  ``--no-pipeline-parallel`` loads;
- ``latest`` (DeepSpeed's tracker) and ``latest_checkpointed_iteration.txt`` beside the tag.

With the training state (``--target-zero-stage 1`` or ``2``, for a Megatron-DeepSpeed run under
DeepSpeed's ZeRO optimizer at that stage and ``--target-data-parallel-size`` ranks), also:

- ``[bf16_]zero_pp_rank_D_mp_rank_MM_optim_states.pt`` per data-parallel rank D and
  model-parallel rank MM (``bf16_`` for bf16 weights, as DeepSpeed names a bf16 run's): per
  parameter group (GPTModelPipe's parameters in the order it registers them, the decayed ones,
  then biases and norms, as Megatron-DeepSpeed groups them), D's slice of the flat fp32 masters
  and of each Adam moment, cut as DeepSpeed cuts them (the group padded with zeros to a multiple
  of 2 x the data-parallel size), with Adam's step, in DeepSpeed's elastic form (a list per
  group), whose loader restores the state tensors alone and keeps the run's own optimizer
  settings;
- in each model-states file, the learning-rate schedule (``lr_scheduler``), the parameter
  shapes per group and the consumed samples in ``args``.

The RNG state is not written: load it with ``--no-load-rng`` (or ``--finetune`` for the weights
alone, which is all an export without ``--target-zero-stage`` holds).

The fused QKV rows of each tensor rank are in the order of the Megatron-DeepSpeed that will load
them, which the caller names (:data:`QKV_ORDERS`): ``per-head`` before its FPDT commit
(676a482c, December 2024), ``blocks`` from it on (its last commit included). Nothing in the
files tells them apart to Megatron-DeepSpeed, so a wrong choice would load silently wrong
weights; a ``blocks`` export carries the FPDT commit's args (``ds_sequence_parallel_fpdt``),
which is how :mod:`zerotron.checkpoint.megatron_deepspeed` tells them apart on import.
"""

from __future__ import annotations

import argparse
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from zerotron.checkpoint.megatron_deepspeed import FPDT_ARG, qkv_heads_to_blocks
from zerotron.checkpoint.reshard import WORD_EMBEDDING
from zerotron.errors import ConfigError
from zerotron.optim import is_no_decay

State = dict[str, torch.Tensor]
FORMAT = "megatron-deepspeed"
TRACKER = "latest"
QKV_ORDERS = ("per-head", "blocks")
FPDT_COMMIT = "676a482c"
DS_FORMAT_VERSION = "0.16.2"
"""The DeepSpeed release whose ZeRO-1/2 optimizer-file format these files follow (its loader
checks that the writer's version is at least 0.3.17)."""
# One GPT-2 transformer layer's parameters in the order GPTModelPipe's modules register them.
LAYER_PARAMS = tuple(
    f"{module}.{param}"
    for module in (
        "input_layernorm",
        "self_attention.query_key_value",
        "self_attention.dense",
        "post_attention_layernorm",
        "mlp.dense_h_to_4h",
        "mlp.dense_4h_to_h",
    )
    for param in ("weight", "bias")
)


def check_qkv_order(order: str | None) -> str:
    """``order`` if it is one of :data:`QKV_ORDERS`; else an error saying how to tell."""
    if order is not None and order in QKV_ORDERS:
        return order
    given = "needs" if order is None else f"got {order!r} for"
    raise ConfigError(
        f"--megatron-format megatron-deepspeed {given} --megatron-deepspeed-qkv per-head or "
        f"blocks: Megatron-DeepSpeed's commit {FPDT_COMMIT} (December 2024) changed the order "
        "of the fused QKV rows, and its files do not say which one they hold",
        where="--megatron-deepspeed-qkv",
        fix="pass per-head for a Megatron-DeepSpeed older than that commit, blocks for it and "
        f"later (`git -C Megatron-DeepSpeed merge-base --is-ancestor {FPDT_COMMIT} HEAD && echo "
        "blocks || echo per-head` tells)",
    )


def tag_name(iteration: int) -> str:
    """DeepSpeed's tag for an iteration."""
    return f"global_step{iteration}"


def deepspeed_args(args: argparse.Namespace, qkv_order: str) -> argparse.Namespace:
    """Megatron-LM's ``args`` (:func:`~zerotron.checkpoint.megatron_export.args_from_config`)
    with the fields Megatron-DeepSpeed compares when it loads without ``--finetune`` (and, for
    the ``blocks`` order, the FPDT commit's flags)."""
    fpdt = {FPDT_ARG: False} if qkv_order == "blocks" else {}
    return argparse.Namespace(
        **vars(args),
        num_key_value_heads=args.num_attention_heads,
        add_position_embedding=True,
        data_parallel_random_init=False,
        deepspeed=True,
        **fpdt,
    )


def in_order(state: State, qkv_order: str, heads: int) -> State:
    """``state`` (one tensor rank's) with its fused QKV rows in ``qkv_order`` (``heads``: the
    rank's attention heads)."""
    if qkv_order == "per-head":
        return state
    return {
        k: qkv_heads_to_blocks(v, heads) if ".query_key_value." in k else v
        for k, v in state.items()
    }


def _layer(key: str) -> tuple[int | None, str]:
    """(global layer index, name within the layer) of one of our keys; None for others."""
    if key.startswith("layers."):
        _, i, rest = key.split(".", 2)
        return int(i), rest
    return None, key


def layer_files(state: State, num_layers: int, tp_rank: int) -> Iterator[tuple[str, State]]:
    """GPTModelPipe's layer files of one (tensor, pipeline) rank's weights: ``(file name,
    state dict)`` for the embedding (first stage), each of its transformer layers and the final
    LayerNorm (last stage)."""
    model = f"model_{tp_rank:02d}"
    if WORD_EMBEDDING in state:
        embedding = {
            "word_embeddings.weight": state[WORD_EMBEDDING],
            "position_embeddings.weight": state["embedding.position_embeddings.weight"],
        }
        yield f"layer_01-{model}-model_states.pt", embedding
    layers: dict[int, State] = {}
    for key, value in state.items():
        index, name = _layer(key)
        if index is not None:
            layers.setdefault(index, {})[name] = value
    for index in sorted(layers):
        yield f"layer_{index + 2:02d}-{model}-model_states.pt", layers[index]
    if "final_layernorm.weight" in state:
        final = {p: state[f"final_layernorm.{p}"] for p in ("weight", "bias")}
        yield f"layer_{num_layers + 2:02d}-{model}-model_states.pt", final


def legacy_module(state: State) -> dict[str, Any]:
    """The legacy GPTModel's state dict of a whole-depth state, nested as Megatron-DeepSpeed's
    ``state_dict_for_save_checkpoint`` nests it (its own names: ``input_layernorm``,
    ``final_layernorm``)."""
    embedding: dict[str, Any] = {}
    encoder: State = {}
    for key, value in state.items():
        index, name = _layer(key)
        if index is not None:
            encoder[f"layers.{index}.{name}"] = value
        elif key.startswith("final_layernorm."):
            encoder[key] = value
        elif key.startswith("embedding."):
            _, part, param = key.split(".")
            embedding[part] = {param: value}
    return {"language_model": {"embedding": embedding, "encoder": encoder}}


def model_states(
    args: argparse.Namespace,
    iteration: int,
    consumed_samples: int,
    mp_world_size: int,
    module: dict[str, Any] | None,
    version: float,
) -> dict[str, Any]:
    """One ``mp_rank_MM_model_states.pt``: DeepSpeed's entries (no optimizer, scheduler or
    sampler state) and Megatron's client state."""
    return {
        "module": module,
        "buffer_names": [],
        "optimizer": None,
        "param_shapes": None,
        "frozen_param_shapes": None,
        "shared_params": None,
        "frozen_param_fragments": None,
        "lr_scheduler": None,
        "data_sampler": None,
        "random_ltd": None,
        "sparse_tensor_module_names": set(),
        "skipped_steps": 0,
        "global_steps": iteration,
        "global_samples": consumed_samples,
        "dp_world_size": 1,
        "mp_world_size": mp_world_size,
        "ds_config": {},
        "args": args,
        "checkpoint_version": version,
        "iteration": iteration,
        "tokens": consumed_samples * args.seq_length,
    }


# ---- the training state ---------------------------------------------------------------------


@dataclass
class TrainingState:
    """What an export with the training state carries besides the weights."""

    kinds: dict[str, State]
    """``master``, ``exp_avg``, ``exp_avg_sq``: fp32 single-process tensors, our names."""
    step: int
    scheduler: dict[str, Any]
    adam: dict[str, float]
    """Megatron's flags for the optimizer's settings (``adam_beta1``, ``adam_beta2``,
    ``adam_eps``, ``weight_decay``): in the files' ``args``, where an import finds them (the
    elastic form keeps no param groups)."""
    zero_stage: int
    data_parallel: int
    bf16: bool
    """Whether the weights are bf16: the loading run then has ``--bf16``, and DeepSpeed looks
    for its optimizer files under ``bf16_zero_pp_rank_*``."""


def pipe_parameters(
    stage: int, stages: int, layers: list[int], num_layers: int
) -> list[tuple[str, str]]:
    """``(DeepSpeed's name, our key)`` of one pipeline stage's parameters, in the order
    GPTModelPipe registers them: its tied embedding module (word and position embeddings) on
    the first and the last stage, the stage's transformer ``layers``, the final LayerNorm on the
    last stage."""
    out = []
    if stage in (0, stages - 1):
        out += [
            ("tied_modules.embed.word_embeddings.weight", WORD_EMBEDDING),
            (
                "tied_modules.embed.position_embeddings.weight",
                "embedding.position_embeddings.weight",
            ),
        ]
    for i in layers:
        out += [(f"{i + 2}.{name}", f"layers.{i}.{name}") for name in LAYER_PARAMS]
    if stage == stages - 1:
        out += [(f"{num_layers + 2}.{p}", f"final_layernorm.{p}") for p in ("weight", "bias")]
    return out


def param_groups(params: list[tuple[str, str]], rank: State) -> list[list[tuple[str, str]]]:
    """``params`` as Megatron-DeepSpeed's optimizer groups them: decayed, then not decayed."""
    # Megatron-DeepSpeed's rule is zerotron's: no decay for biases and 1-D parameters
    decayed = [p for p in params if not is_no_decay(p[0], rank[p[1]])]
    other = [p for p in params if is_no_decay(p[0], rank[p[1]])]
    return [g for g in (decayed, other) if g]


def zero_files(
    kinds: dict[str, State], groups: list[list[tuple[str, str]]], mp_rank: int, train: TrainingState
) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(file name, contents)`` of model-parallel rank ``mp_rank``'s ZeRO optimizer files, one
    per data-parallel rank (``kinds``: the rank's fp32 master and moments, cut and ordered as
    its weights are)."""
    dp = train.data_parallel
    flats = {
        kind: [torch.cat([state[key].reshape(-1).float() for _, key in g]) for g in groups]
        for kind, state in kinds.items()
    }
    # DeepSpeed pads each group to a multiple of 2 x dp and saves the slices without the
    # padding, recording it in group_paddings; its loader pads every state tensor of the
    # (still empty) optimizer by that much again, Adam's 0-d step included, which torch's Adam
    # cannot step with. So the padding is written here as zeros inside the last slice, with
    # group_paddings 0: the same tensors once loaded.
    for kind, flat in flats.items():
        flats[kind] = [torch.nn.functional.pad(f, (0, -f.numel() % (2 * dp))) for f in flat]
    step = torch.tensor(float(train.step))
    prefix = "bf16_" if train.bf16 else ""  # as DeepSpeed names them in a bf16 run
    for d in range(dp):

        def part(kind: str, d: int = d) -> list[torch.Tensor]:
            return [f.chunk(dp)[d].clone() for f in flats[kind]]

        moments = dict(exp_avg=part("exp_avg"), exp_avg_sq=part("exp_avg_sq"))
        osd = {  # no clip_grad, loss scaler or overflow flag: the loading run keeps its own
            "base_optimizer_state": [
                {"step": step.clone(), "exp_avg": a, "exp_avg_sq": b}
                for a, b in zip(moments["exp_avg"], moments["exp_avg_sq"])
            ],
            "base_optimizer_state_step": train.step,
            "single_partition_of_fp32_groups": part("master"),
            "zero_stage": train.zero_stage,
            "group_paddings": [0] * len(groups),
            "partition_count": [dp] * len(groups),
            "ds_version": DS_FORMAT_VERSION,
        }
        name = f"{prefix}zero_pp_rank_{d}_mp_rank_{mp_rank:02d}_optim_states.pt"
        yield name, {"optimizer_state_dict": osd, "ds_version": DS_FORMAT_VERSION}


def param_shapes(groups: list[list[tuple[str, str]]], rank: State) -> list[OrderedDict]:
    """DeepSpeed's ``param_shapes`` of a model-states file: per group, name -> shape."""
    return [OrderedDict((name, rank[key].shape) for name, key in g) for g in groups]


def scheduler_state(
    scheduler: dict[str, Any], consumed_samples: int, seq_length: int
) -> dict[str, Any]:
    """zerotron's (Megatron's) scheduler state with the token counts Megatron-DeepSpeed's
    scheduler also reads (a schedule in samples: no token lengths)."""
    return {
        **scheduler,
        "lr_warmup_tokens": None,
        "lr_decay_tokens": None,
        "num_tokens": consumed_samples * seq_length,
    }
