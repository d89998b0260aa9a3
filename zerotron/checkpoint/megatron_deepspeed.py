"""Megatron-DeepSpeed's GPT checkpoints, read as Megatron-LM's legacy per-rank files.

Megatron-DeepSpeed (microsoft/Megatron-DeepSpeed, the scripts of DeepSpeed's GPT tutorials)
saves through DeepSpeed's engine: DeepSpeed's ``latest`` names ``global_stepN/``, and Megatron's
``latest_checkpointed_iteration.txt`` sits beside it. In the tag directory::

    mp_rank_MM_model_states.pt          one per model-parallel rank: Megatron's ``args``,
                                        ``checkpoint_version``, ``iteration``, DeepSpeed's
                                        counters; ``module`` is the legacy GPTModel state dict
                                        (``language_model.encoder.layers.N...``) with
                                        ``--no-pipeline-parallel``, None with the pipeline engine
    layer_LL-model_TT-model_states.pt   pipeline engine only: one per layer of GPTModelPipe and
                                        tensor rank TT (LL counts the layer list: the embedding,
                                        each transformer layer, the final LayerNorm; the tied
                                        output layer has no file), names relative to the layer
    [bf16_]zero_pp_rank_*_optim_states.pt   ZeRO optimizer partitions (not read here)

:func:`read_rank_files` puts each tensor rank's weights under the legacy names, with global
layer indices, so :func:`zerotron.checkpoint.megatron.read_megatron` merges them as it merges
Megatron-LM's (the pipeline stages' layer files are already one model per tensor rank).

QKV rows: Megatron-DeepSpeed ordered each tensor rank's fused QKV rows per head (``[heads, (q,
k, v), d]``, Megatron-LM's and ours) until its FPDT commit (676a482c, December 2024), which
split them as ``[(q, k, v), heads, d]`` blocks instead. That commit also added the
``--ds-sequence-parallel-fpdt`` flag, so a checkpoint whose args have it was written with the
block order: :func:`zerotron.checkpoint.megatron.read_megatron` reorders its rows as it does
legacy checkpoint version 0's, which have that order too.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch

from zerotron.checkpoint import megatron_io as mio
from zerotron.checkpoint.layout import METADATA_FILE
from zerotron.errors import CheckpointError, UnsupportedError

ZERO3_REFUSAL = (
    "the weights of a ZeRO stage 3 run are in its zero_pp_rank_* optimizer files, partitioned; "
    "its mp_rank_* files hold none"
)
ZERO3_FIX = (
    "save with DeepSpeed's stage3_gather_16bit_weights_on_model_save, or convert with "
    "DeepSpeed's zero_to_fp32 first"
)
_LAYER_STATES = re.compile(r"layer_(\d{2,})-model_(\d{2,})-model_states\.pt")
# An args key only Megatron-DeepSpeed's FPDT commit and later have (see the module docstring).
FPDT_ARG = "ds_sequence_parallel_fpdt"


def qkv_blocks_to_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Fused QKV rows ordered ``[(q, k, v), heads, d]`` in our ``[heads, (q, k, v), d]``."""
    rest = t.shape[1:]
    return t.reshape(3, heads, -1, *rest).transpose(0, 1).reshape(t.shape).contiguous()


def qkv_heads_to_blocks(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Fused QKV rows ordered ``[heads, (q, k, v), d]`` (ours) in ``[(q, k, v), heads, d]``."""
    rest = t.shape[1:]
    return t.reshape(heads, 3, -1, *rest).transpose(0, 1).reshape(t.shape).contiguous()


def _megatron_args(file: Path, mmap: bool = False) -> tuple[dict[str, Any], Any] | None:
    """(the loaded file, its Megatron args) when ``file`` holds Megatron's args, else None."""
    loaded = mio.load_safe(file, mmap=mmap)
    args = loaded.get("args") if isinstance(loaded, dict) else None
    if args is None or not hasattr(args, "num_layers"):
        return None
    return loaded, args


def is_megatron_deepspeed(tag: Path) -> bool:
    """Whether ``tag`` holds DeepSpeed's model-states files with Megatron's args in them (and not
    zerotron's metadata.json)."""
    first = tag / mio.DEEPSPEED_MODEL_STATES
    if (tag / METADATA_FILE).is_file() or not first.is_file():
        return False
    try:
        return _megatron_args(first, mmap=True) is not None
    except CheckpointError:  # a type Megatron's files never hold: some other DeepSpeed model's
        return False


def layer_files(tag: Path) -> dict[int, dict[int, Path]]:
    """``{tensor rank: {layer index: file}}`` of a pipeline engine's layer files (none without
    the pipeline engine)."""
    found: dict[int, dict[int, Path]] = {}
    for child in tag.iterdir():
        m = _LAYER_STATES.fullmatch(child.name)
        if m:
            found.setdefault(int(m.group(2)), {})[int(m.group(1))] = child
    return found


def layer_roles(indices: Collection[int]) -> dict[int, str]:
    """What each of GPTModelPipe's layer indices is: the first "embedding", the last "final"
    (LayerNorm), those between "layer N" (the transformer layers, N counted from 0)."""
    order = sorted(indices)
    roles = {order[0]: "embedding", order[-1]: "final"}
    roles.update({index: f"layer {i}" for i, index in enumerate(order[1:-1])})
    return roles


def legacy_prefix(role: str) -> str:
    """The legacy GPTModel's name prefix of a GPTModelPipe layer of ``role``
    (:func:`layer_roles`)."""
    if role == "embedding":
        return "language_model.embedding."
    if role == "final":
        return "language_model.encoder.final_layernorm."
    return f"language_model.encoder.layers.{role.removeprefix('layer ')}."


def _pipeline_model(files: dict[int, Path], layers: Collection[int] | None) -> dict[str, Any]:
    """One tensor rank's GPTModelPipe layer files as a legacy GPTModel state dict: the first
    file is the embedding, the last the final LayerNorm, those between the transformer layers in
    order; of those, only ``layers`` (global indices; None: all) are read."""
    roles = layer_roles(files)
    model: dict[str, Any] = {}
    for index in sorted(files):
        role = roles[index]
        if role.startswith("layer ") and layers is not None and int(role[6:]) not in layers:
            continue
        state = mio.load_safe(files[index])
        if not isinstance(state, dict):
            raise CheckpointError(
                f"holds a {type(state).__name__}, not a state dict", where=str(files[index])
            )
        if (
            (role == "embedding" and "word_embeddings.weight" in state)
            or (role.startswith("layer ") and any(k.startswith("self_attention.") for k in state))
            or (role == "final" and set(state) <= {"weight", "bias"})
        ):
            prefix = legacy_prefix(role)
        else:
            raise UnsupportedError(
                f"pipeline layer {index} holds {sorted(state)[:4]}, which is not the {role} of "
                "a GPT-2 GPTModelPipe (embedding, transformer layers, final LayerNorm)",
                where=str(files[index]),
                fix="only GPT-2-style Megatron-DeepSpeed models convert",
            )
        model.update({prefix + key: value for key, value in state.items()})
    return model


def has_layer_files(tag: Path) -> bool:
    """Whether ``tag`` holds the pipeline engine's layer files."""
    return bool(layer_files(tag))


def read_rank_files(
    tag: Path, tensor_rank: int | None = None, layers: Collection[int] | None = None
) -> tuple[dict[tuple[int, int], dict], int, int, str]:
    """A Megatron-DeepSpeed checkpoint as Megatron-LM's per-rank files: ``({(tensor rank, 0):
    {"model", "args", "checkpoint_version", "iteration"}}, tensor size, the run's pipeline
    size, its format: "pipeline-engine" or "no-pipeline-parallel")``. Every tensor rank's
    ``model`` holds all layers (global indices) and the QKV rows as saved (:data:`FPDT_ARG`
    in ``args`` tells their order); with ``tensor_rank``, only that rank's files
    are read (and the args file); with ``layers`` (pipeline engine only), only those transformer
    layers' files, the embedding's and the final LayerNorm's."""
    states = tag / mio.DEEPSPEED_MODEL_STATES
    found = _megatron_args(states, mmap=True)  # tensor rank 0's weights read only when used
    if found is None:
        raise CheckpointError("no Megatron args in the file", where=str(states))
    first, args = found
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    stage = (first.get("ds_config") or {}).get("zero_optimization", {}).get("stage", 0)
    found_layers = layer_files(tag)
    ranks = range(tp) if tensor_rank is None else [tensor_rank]
    models: dict[int, dict] = {}
    if found_layers:
        indices = sorted({i for files in found_layers.values() for i in files})
        absent = [
            f"layer_{i:02d}-model_{t:02d}-model_states.pt"
            for t in range(tp)
            for i in indices
            if i not in found_layers.get(t, {})
        ]
        if absent:
            raise CheckpointError(
                f"layer files are missing: {', '.join(absent[:6])}"
                + (f" and {len(absent) - 6} more" if len(absent) > 6 else ""),
                where=str(tag),
                fix="copy the whole checkpoint directory",
            )
        models = {t: _pipeline_model(found_layers[t], layers) for t in ranks}
    else:
        if stage == 3:
            raise UnsupportedError(ZERO3_REFUSAL, where=str(tag), fix=ZERO3_FIX)
        for t in ranks:
            file = tag / f"mp_rank_{t:02d}_model_states.pt"
            if not file.is_file():
                raise CheckpointError(
                    f"{file.name} is missing (tensor rank {t} of {tp})",
                    where=str(tag),
                    fix="copy the whole checkpoint directory",
                )
            loaded = first if t == 0 else mio.load_safe(file)
            module = loaded.get("module") if isinstance(loaded, dict) else None
            if not isinstance(module, dict):
                raise CheckpointError("no 'module' state dict", where=str(file))
            models[t] = module
        pp = 1  # --no-pipeline-parallel: the whole model on every tensor rank
    files = {
        (t, 0): {
            "model": model,
            "args": args,
            "checkpoint_version": first.get("checkpoint_version"),
            "iteration": first.get("iteration"),
        }
        for t, model in models.items()
    }
    return files, tp, pp, "pipeline-engine" if found_layers else "no-pipeline-parallel"
