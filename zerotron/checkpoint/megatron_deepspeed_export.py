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

No optimizer or RNG state: load it in Megatron-DeepSpeed with ``--finetune``.

The fused QKV rows of each tensor rank are in the order of the Megatron-DeepSpeed that will load
them, which the caller names (:data:`QKV_ORDERS`): ``per-head`` before its FPDT commit
(676a482c, December 2024), ``blocks`` from it on (its last commit included). Nothing in the
files tells them apart to Megatron-DeepSpeed, so a wrong choice would load silently wrong
weights; a ``blocks`` export carries the FPDT commit's args (``ds_sequence_parallel_fpdt``),
which is how :mod:`zerotron.checkpoint.megatron_deepspeed` tells them apart on import.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import Any

import torch

from zerotron.checkpoint.megatron_deepspeed import FPDT_ARG, qkv_heads_to_blocks
from zerotron.checkpoint.reshard import WORD_EMBEDDING
from zerotron.errors import ConfigError

State = dict[str, torch.Tensor]
FORMAT = "megatron-deepspeed"
TRACKER = "latest"
QKV_ORDERS = ("per-head", "blocks")
FPDT_COMMIT = "676a482c"


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
