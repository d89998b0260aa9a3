"""Reshard a GPT checkpoint's model weights between tensor/pipeline-parallel layouts.

A checkpoint saved at (tp, pp) holds one ``mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt`` per
model-parallel rank, each with the GPT's own parameter names (``layers.5...`` keeps its global
index on whichever stage holds it). :func:`merge_model_shards` puts them back together into the
single-process state dict; :func:`split_model_state` cuts that for one rank of another layout;
:func:`load_model_state_for` does both straight from a checkpoint directory.

How the GPT's tensors are split across tensor-parallel ranks (``models/gpt.py`` built from
``parallel/tensor/layers.py``, :data:`PARTITION_DIMS`):

- column-parallel (``ColumnParallelLinear``, output rows, dim 0): ``query_key_value`` weight and
  bias, ``mlp.dense_h_to_4h`` weight and bias. The fused QKV rows are ordered per head
  (``[heads, (q, k, v), head_dim]``), so a plain split along dim 0 hands each rank whole heads
  and concatenation restores the full matrix (partition stride 1);
- row-parallel (``RowParallelLinear``, input columns, dim 1): ``self_attention.dense.weight``
  and ``mlp.dense_4h_to_h.weight``; their biases are replicated;
- vocab-parallel (``VocabParallelEmbedding``, dim 0): ``embedding.word_embeddings.weight`` and
  the last pipeline stage's tied copy ``output_layer.weight``. Their rows are the vocabulary
  padded to a multiple of ``make_vocab_size_divisible_by × tp``, so another TP size may need
  another padding: the real rows are kept and the padding redone (:func:`repad_vocab`; padding
  rows are zero and never trained);
- everything else (LayerNorms, position embeddings, row-parallel biases) is replicated: TP rank
  0's copy is taken.

Pipeline stages: stage files hold disjoint sets of layers (uniform partition, as ``zerotron
pretrain`` cuts them), the embedding on the first stage, the final LayerNorm on the last, which
with pp > 1 also holds ``output_layer.weight``, a copy of the tied embedding kept equal by the
tied-gradient all-reduce. A merged state keeps the embedding once (the first stage's) and drops
the copy; a split for pp > 1 gives the last stage its copy again.

This module moves model weights alone (:func:`load_model_state_for` for one rank in memory,
:func:`reshard_checkpoint` offline: weights, step counters and metadata; resume with
``--finetune`` or ``--no-load-optim``). ``zerotron convert --target-*`` carries the optimizer
state too (fp32 masters, Adam moments, ZeRO partitions of any data-parallel size): see
:mod:`zerotron.checkpoint.convert_layout`, which builds on the rules here.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from zerotron.checkpoint.layout import CHECKPOINT_VERSION, model_file
from zerotron.checkpoint.save_load import load_file, read_metadata, resolve_tag, save_checkpoint
from zerotron.checkpoint.state import repad_vocab
from zerotron.data.tokenizer import vocab_size_with_padding
from zerotron.errors import CheckpointError, ConfigError
from zerotron.pipeline.partition import partition_uniform, stage_layers
from zerotron.progress import Progress

WORD_EMBEDDING = "embedding.word_embeddings.weight"
TIED_COPY = "output_layer.weight"  # the last pipeline stage's copy of the word embedding
VOCAB_KEYS = (WORD_EMBEDDING, TIED_COPY)

# Suffix of a parameter name -> the dimension its tensor-parallel shards split.
PARTITION_DIMS: dict[str, int] = {
    "self_attention.query_key_value.weight": 0,
    "self_attention.query_key_value.bias": 0,
    "mlp.dense_h_to_4h.weight": 0,
    "mlp.dense_h_to_4h.bias": 0,
    "self_attention.dense.weight": 1,
    "mlp.dense_4h_to_h.weight": 1,
    WORD_EMBEDDING: 0,
    TIED_COPY: 0,
}

_LAYER = re.compile(r"layers\.(\d+)\.")

State = dict[str, Tensor]


def partition_dim(key: str) -> int | None:
    """The dimension along which ``key``'s tensor is split across TP ranks; None: replicated."""
    for suffix, dim in PARTITION_DIMS.items():
        if key == suffix or key.endswith("." + suffix):
            return dim
    return None


def _layer_index(key: str) -> int | None:
    m = _LAYER.match(key)
    return int(m.group(1)) if m else None


# ---- merge ------------------------------------------------------------------------------------


def merge_model_shards(
    shards: Mapping[tuple[int, int], Mapping[str, Tensor]],
    tp_size: int,
    pp_size: int,
    *,
    where: str = "",
) -> State:
    """One single-process state dict from every model-parallel rank's ``model`` state dict.

    ``shards[(tp_rank, pp_rank)]`` is that rank's state dict (GPT parameter names). TP shards
    are concatenated along their :func:`partition_dim` (the vocabulary keeps the source's
    padding), replicated tensors come from TP rank 0, pipeline stages are united and the tied
    copy ``output_layer.weight`` is dropped (the embedding is kept once).
    """
    missing = [(t, p) for p in range(pp_size) for t in range(tp_size) if (t, p) not in shards]
    if missing:
        raise CheckpointError(
            f"model shards missing for (tensor, pipeline) ranks {missing} of a "
            f"{tp_size}x{pp_size} layout",
            where=where or None,
        )
    full: State = {}
    owner: dict[str, int] = {}
    for p in range(pp_size):
        stage = [shards[(t, p)] for t in range(tp_size)]
        keys = list(stage[0])
        for t, other in enumerate(stage[1:], 1):
            if set(other) != set(keys):
                diff = sorted(set(other) ^ set(keys))
                raise CheckpointError(
                    f"tensor-parallel ranks 0 and {t} of pipeline stage {p} hold different "
                    f"tensors: {diff[:5]}",
                    where=where or None,
                    fix="the checkpoint is incomplete or mixes saves; re-save it",
                )
        for key in keys:
            if key == TIED_COPY:
                continue  # the first stage's embedding is the one weight
            if key in owner:
                raise CheckpointError(
                    f"{key} is held by pipeline stages {owner[key]} and {p}",
                    where=where or None,
                    fix="the checkpoint mixes saves of different layouts; re-save it",
                )
            owner[key] = p
            dim = partition_dim(key)
            parts = [s[key] for s in stage]
            full[key] = parts[0] if dim is None or tp_size == 1 else torch.cat(parts, dim=dim)
    if pp_size > 1 and WORD_EMBEDDING not in full:
        raise CheckpointError(
            f"no {WORD_EMBEDDING} on the first pipeline stage", where=where or None
        )
    return full


# ---- split ------------------------------------------------------------------------------------


def num_layers_of(state: Mapping[str, Tensor]) -> int:
    """The number of transformer layers a full state dict holds (``layers.{i}.`` keys)."""
    indices = {i for i in map(_layer_index, state) if i is not None}
    if indices != set(range(len(indices))):
        raise CheckpointError(
            f"the state dict's layers are {sorted(indices)}, not 0..{len(indices) - 1}",
            fix="merge every pipeline stage first (merge_model_shards)",
        )
    return len(indices)


def stage_layer_indices(
    num_layers: int, pp_rank: int, pp_size: int, virtual_stages: int = 1
) -> list[int]:
    """The global layer indices pipeline rank ``pp_rank`` holds (uniform partition)."""
    bounds = partition_uniform(num_layers, pp_size, virtual_stages)
    return [i for c in range(virtual_stages) for i in stage_layers(bounds, pp_rank, pp_size, c)]


def split_model_state(
    full: Mapping[str, Tensor],
    tp_rank: int,
    tp_size: int,
    pp_rank: int = 0,
    pp_size: int = 1,
    *,
    orig_vocab_size: int | None = None,
    padded_vocab_size: int | None = None,
    virtual_stages: int = 1,
    num_layers: int | None = None,
) -> State:
    """The state dict of rank (``tp_rank``, ``pp_rank``) of a (``tp_size``, ``pp_size``) layout.

    ``full`` is a single-process state dict (:func:`merge_model_shards`), or the part of one
    that holds the word embedding and at least this rank's layers, with ``num_layers`` the
    model's. ``padded_vocab_size``
    is the target's embedding rows (all TP ranks together); when it differs from ``full``'s, the
    vocabulary is re-padded keeping ``orig_vocab_size`` real rows. Every tensor is a fresh,
    contiguous copy (saving a view would write the whole original).
    """
    for name, rank, size in (("tensor", tp_rank, tp_size), ("pipeline", pp_rank, pp_size)):
        if not 0 <= rank < size:
            raise ConfigError(f"{name}-parallel rank {rank} is outside 0..{size - 1}")
    embedding = full[WORD_EMBEDDING]
    rows = padded_vocab_size or embedding.shape[0]
    if rows % tp_size:
        raise ConfigError(
            f"{rows} vocabulary rows do not split over {tp_size} tensor-parallel ranks",
            where="padded_vocab_size",
            fix="pad the vocabulary to a multiple of make_vocab_size_divisible_by x tp",
        )
    if rows != embedding.shape[0]:
        if orig_vocab_size is None:
            raise ConfigError(
                f"re-padding {embedding.shape[0]} vocabulary rows to {rows} needs the real "
                "vocabulary size",
                where="orig_vocab_size",
            )
        embedding = repad_vocab(embedding, orig_vocab_size, rows)

    num_layers = num_layers or num_layers_of(full)
    layers = set(stage_layer_indices(num_layers, pp_rank, pp_size, virtual_stages))
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    out: State = {}
    for key, tensor in full.items():
        if key == TIED_COPY:
            continue
        layer = _layer_index(key)
        if layer is not None:
            keep = layer in layers
        elif key.startswith("embedding."):
            keep = first
        else:  # final_layernorm
            keep = last
        if keep:
            out[key] = _shard(embedding if key == WORD_EMBEDDING else tensor, key, tp_rank, tp_size)
    if last and pp_size > 1:
        out[TIED_COPY] = _shard(embedding, TIED_COPY, tp_rank, tp_size)
    return out


def _shard(tensor: Tensor, key: str, tp_rank: int, tp_size: int) -> Tensor:
    dim = partition_dim(key)
    if dim is not None and tp_size > 1:
        if tensor.shape[dim] % tp_size:
            raise ConfigError(
                f"{key}: dimension {dim} of {list(tensor.shape)} does not split over "
                f"{tp_size} tensor-parallel ranks",
                fix="choose a tensor-parallel size that divides the heads, hidden and ffn sizes",
            )
        tensor = tensor.chunk(tp_size, dim=dim)[tp_rank]
    return tensor.contiguous().clone()


# ---- from a checkpoint ------------------------------------------------------------------------


def checkpoint_layout(meta: Mapping[str, Any]) -> tuple[int, int]:
    """(tensor, pipeline) parallel sizes a checkpoint was saved with, from its metadata."""
    layout = meta.get("layout") or {}
    return (
        int(layout.get("tensor_model_parallel_size", 1)),
        int(layout.get("pipeline_model_parallel_size", 1)),
    )


def orig_vocab_size_of(meta: Mapping[str, Any]) -> int | None:
    """The tokenizer's (unpadded) vocabulary recorded in a checkpoint's metadata."""
    size = (meta.get("vocab") or {}).get("size")
    if size is None:
        size = (meta.get("model") or {}).get("orig_vocab_size")
    return None if size is None else int(size)


def load_merged_state(
    load_dir: str | os.PathLike, tag: str | None = None
) -> tuple[State, dict[str, Any]]:
    """Every model file of a checkpoint merged into one state dict; with its metadata."""
    full, meta, _ = _load_merged(load_dir, tag)
    return full, meta


def _load_merged(
    load_dir: str | os.PathLike, tag: str | None
) -> tuple[State, dict[str, Any], dict[str, Any]]:
    """(merged weights, metadata, the non-weight entries of the first rank's file)."""
    tag = resolve_tag(load_dir, tag)
    meta = read_metadata(load_dir, tag)
    tp, pp = checkpoint_layout(meta)
    shards, extra = {}, {}
    for p in range(pp):
        for t in range(tp):
            state = _file_state(load_dir, tag, model_file(t, p, pp))
            shards[(t, p)] = state.pop("model")
            if (t, p) == (0, 0):
                extra = state
            del state  # optimizer states of other ranks are not kept in memory
    where = os.path.join(str(load_dir), tag)
    return merge_model_shards(shards, tp, pp, where=where), meta, extra


def _file_state(load_dir: str | os.PathLike, tag: str, relpath: str) -> dict[str, Any]:
    state = load_file(load_dir, tag, relpath)
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(
            "no 'model' entry in the checkpoint file",
            where=os.path.join(str(load_dir), tag, relpath),
        )
    return state


def _model_state(load_dir: str | os.PathLike, tag: str, relpath: str) -> State:
    return _file_state(load_dir, tag, relpath)["model"]


def target_padded_vocab_size(
    meta: Mapping[str, Any], tp_size: int, make_vocab_size_divisible_by: int = 128
) -> int:
    """The embedding rows a ``tp_size`` run pads this checkpoint's vocabulary to."""
    orig = orig_vocab_size_of(meta)
    if orig is None:
        raise CheckpointError(
            "metadata.json records no vocabulary size",
            fix="re-save the checkpoint with zerotron (its metadata has 'vocab')",
        )
    return vocab_size_with_padding(orig, make_vocab_size_divisible_by, tp_size, log=False)


def load_model_state_for(
    load_dir: str | os.PathLike,
    tag: str | None,
    tp_rank: int,
    tp_size: int,
    pp_rank: int = 0,
    pp_size: int = 1,
    *,
    padded_vocab_size: int | None = None,
    make_vocab_size_divisible_by: int = 128,
    virtual_stages: int = 1,
) -> tuple[State, dict[str, Any]]:
    """Model weights for rank (``tp_rank``, ``pp_rank``) of a (``tp_size``, ``pp_size``) run,
    from a checkpoint of any layout; with the checkpoint's metadata.

    ``padded_vocab_size`` is the target model's embedding rows (default: the vocabulary padded
    to ``make_vocab_size_divisible_by × tp_size``, Megatron's rule). On the saved layout with the
    saved padding the rank's own file is read as it is; otherwise all files are merged and split.
    """
    tag = resolve_tag(load_dir, tag)
    meta = read_metadata(load_dir, tag)
    if padded_vocab_size is None:
        padded_vocab_size = target_padded_vocab_size(meta, tp_size, make_vocab_size_divisible_by)
    saved_rows = (meta.get("vocab") or {}).get("padded_size")
    num_layers = (meta.get("model") or {}).get("num_layers")
    if (
        checkpoint_layout(meta) == (tp_size, pp_size)
        and saved_rows == padded_vocab_size
        and num_layers is not None
    ):
        own = _model_state(load_dir, tag, model_file(tp_rank, pp_rank, pp_size))
        # The same layers too (the metadata does not record virtual pipeline stages).
        want = stage_layer_indices(num_layers, pp_rank, pp_size, virtual_stages)
        if {i for i in map(_layer_index, own) if i is not None} == set(want):
            return own, meta
    full, meta = load_merged_state(load_dir, tag)
    state = split_model_state(
        full,
        tp_rank,
        tp_size,
        pp_rank,
        pp_size,
        orig_vocab_size=orig_vocab_size_of(meta),
        padded_vocab_size=padded_vocab_size,
        virtual_stages=virtual_stages,
    )
    return state, meta


# ---- offline conversion -----------------------------------------------------------------------

# Entries of a model file that belong to one rank's optimizer or RNG streams, or describe the
# old run's flags: a resharded checkpoint does not carry them.
DROPPED_ENTRIES = ("optimizer", "rng_state", "args")


def load_shared_entries(load_dir: str | os.PathLike, tag: str | None = None) -> dict[str, Any]:
    """What a checkpoint's model files share whatever the layout: the first rank's entries
    without the weights and :data:`DROPPED_ENTRIES` (iteration, consumed samples, step counters,
    LR-scheduler state, checkpoint version). For loading weights from another layout."""
    tag = resolve_tag(load_dir, tag)
    _, pp = checkpoint_layout(read_metadata(load_dir, tag))
    state = _file_state(load_dir, tag, model_file(0, 0, pp))
    return {k: v for k, v in state.items() if k != "model" and k not in DROPPED_ENTRIES}


def reshard_checkpoint(
    load_dir: str | os.PathLike,
    save_dir: str | os.PathLike,
    tensor_model_parallel_size: int,
    pipeline_model_parallel_size: int = 1,
    *,
    tag: str | None = None,
    make_vocab_size_divisible_by: int = 128,
    progress: Progress | None = None,
) -> Path:
    """Write ``load_dir``'s checkpoint (tag ``tag``, default the latest) to ``save_dir`` under
    the same tag, laid out for (``tensor_model_parallel_size``, ``pipeline_model_parallel_size``).

    The vocabulary is padded as a run of the target layout pads it (a multiple of
    ``make_vocab_size_divisible_by × tp``). Each file holds the rank's weights, the checkpoint
    version and the step counters (iteration, consumed samples, LR-scheduler state) of the
    source; optimizer and RNG states are not resharded (:data:`DROPPED_ENTRIES`), so resume with
    ``--finetune`` or ``--no-load-optim``. metadata.json records the new layout and, under
    ``resharded_from``, the old one. ``progress`` (total ``2 + tp × pp``) counts the read,
    each target rank's split and the write.
    """
    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    for flag, size in (("tensor", tp), ("pipeline", pp)):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigError(
                f"target {flag}-parallel size must be a positive integer, got {size!r}",
                where=f"--target-{flag}-parallel-size",
            )
    tag = resolve_tag(load_dir, tag)
    full, meta, extra = _load_merged(load_dir, tag)
    if progress is not None:
        progress.update(1, info=f"read {tag}")
    num_layers = num_layers_of(full)
    if num_layers < pp:
        raise ConfigError(
            f"{num_layers} layers cannot fill {pp} pipeline stages",
            where="--target-pipeline-parallel-size",
            fix=f"use at most {num_layers} stages",
        )
    rows = target_padded_vocab_size(meta, tp, make_vocab_size_divisible_by)
    orig = orig_vocab_size_of(meta)
    kept = {k: v for k, v in extra.items() if k not in DROPPED_ENTRIES}
    kept.setdefault("checkpoint_version", CHECKPOINT_VERSION)
    files = {}
    for p in range(pp):
        for t in range(tp):
            state = split_model_state(
                full, t, tp, p, pp, orig_vocab_size=orig, padded_vocab_size=rows
            )
            files[model_file(t, p, pp)] = {**kept, "model": state}
            if progress is not None:
                progress.update(1, info=f"split {model_file(t, p, pp)}")
    src_tp, src_pp = checkpoint_layout(meta)
    new_meta = {k: v for k, v in meta.items() if k not in _WRITTEN_BY_SAVE}
    new_meta["layout"] = {
        **(meta.get("layout") or {}),
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "data_parallel_size": 1,
        "zero_stage": 0,
    }
    if "model" in meta:
        new_meta["model"] = {**meta["model"], "vocab_size": rows}
    new_meta["vocab"] = {**(meta.get("vocab") or {}), "size": orig, "padded_size": rows}
    new_meta["optimizer_states"] = False
    new_meta["resharded_from"] = {
        "load": os.fspath(load_dir),
        "tag": tag,
        "tensor_model_parallel_size": src_tp,
        "pipeline_model_parallel_size": src_pp,
        "padded_vocab_size": (meta.get("vocab") or {}).get("padded_size"),
    }
    path = save_checkpoint(save_dir, tag, files, new_meta)
    if progress is not None:
        progress.update(1, info=f"wrote {path}")
    return path


# Keys save_checkpoint writes into metadata.json itself.
_WRITTEN_BY_SAVE = ("format_version", "tag", "iteration", "files", "versions", "saved_at")
