"""Megatron-LM GPT checkpoints in: megatron-core, legacy and torch_dist layouts read as ours
(and Megatron-DeepSpeed's, which :mod:`~zerotron.checkpoint.megatron_deepspeed` presents as
legacy per-rank files).

(:mod:`~zerotron.checkpoint.megatron_export` writes them, :mod:`~zerotron.checkpoint.megatron_io`
finds, reads and writes the files, :mod:`~zerotron.checkpoint.megatron_args` reads the ``args``
and tells what a checkpoint is without its weights.)

Name map, per transformer layer (megatron-core names after ``decoder.layers.N.``, legacy ones
after ``language_model.encoder.layers.N.``; ours after ``layers.N.``)::

    megatron-core                          legacy                          zerotron
    input_layernorm.*                      input_norm.* (input_layernorm)  input_layernorm.*
      (TE: self_attention.linear_qkv.layer_norm_{weight,bias})
    self_attention.linear_qkv.*            self_attention.query_key_value  same as legacy
    self_attention.linear_proj.*           self_attention.dense.*          self_attention.dense.*
    pre_mlp_layernorm.*                    post_attention_norm.*           post_attention_layernorm
      (TE: mlp.linear_fc1.layer_norm_{weight,bias})  (post_attention_layernorm)
    mlp.linear_fc1.*                       mlp.dense_h_to_4h.*             mlp.dense_h_to_4h.*
    mlp.linear_fc2.*                       mlp.dense_4h_to_h.*             mlp.dense_4h_to_h.*

and ``embedding.*`` (legacy: ``language_model.embedding.*``), ``decoder.final_layernorm``
(legacy: ``language_model.encoder.final_norm``), the last stage's tied copy ``output_layer``
(legacy: ``word_embeddings_for_head``). Layer indices in per-rank files are local to their
pipeline stage (and virtual chunk); ``torch_dist`` stacks every layer's tensor on a leading axis.

QKV order: megatron-core's ``linear_qkv`` rows are ``[query groups, (queries of the group, k,
v), head_dim]``; with one query per group (multi-head attention, the only kind GPT-2 has) that is
``[heads, (q, k, v), head_dim]``, the legacy order (checkpoint_version >= 2) and ours, so rows
are copied as they are. Legacy checkpoint versions 0 and 1 ordered them ``[(q, k, v), heads, d]``
and ``[heads, d, (q, k, v)]`` per tensor-parallel rank and are reordered on import.

``args`` (Megatron-LM's flags, saved in every file) give the model's shape; what zerotron's GPT
cannot represent (SwiGLU, RMSNorm, rotary positions, grouped queries, untied output layer, no
linear biases, exact-erf GELU...) is refused with what differs.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import torch

from zerotron.checkpoint import megatron_io as mio
from zerotron.checkpoint.megatron_args import (
    args_dict,
    args_file,
    config_from_args,
    is_legacy,
    megatron_model_args,
    model_chunks,
    tokenizer_of,
)
from zerotron.checkpoint.megatron_deepspeed import (
    FPDT_ARG,
    is_megatron_deepspeed,
    qkv_blocks_to_heads,
    read_rank_files,
)
from zerotron.checkpoint.reshard import (
    TIED_COPY,
    WORD_EMBEDDING,
    merge_model_shards,
    partition_dim,
)
from zerotron.checkpoint.save_load import build_metadata
from zerotron.errors import CheckpointError, ConfigError, UnsupportedError
from zerotron.models.gpt import GPTConfig
from zerotron.pipeline.partition import partition_uniform

FORMATS = ("mcore", "legacy", "torch_dist")
CHECKPOINT_VERSION = 3.0

# Per-layer module names: megatron-core -> ours, legacy -> ours.
MCORE_LAYER = {
    "input_layernorm": "input_layernorm",
    "self_attention.linear_qkv": "self_attention.query_key_value",
    "self_attention.linear_proj": "self_attention.dense",
    "pre_mlp_layernorm": "post_attention_layernorm",
    "mlp.linear_fc1": "mlp.dense_h_to_4h",
    "mlp.linear_fc2": "mlp.dense_4h_to_h",
}
# Transformer Engine's fused LayerNorm-linear names (and torch_dist's for every spec).
TE_FUSED = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "post_attention_layernorm.bias",
}
LEGACY_LAYER = {
    "input_norm": "input_layernorm",
    "input_layernorm": "input_layernorm",
    "self_attention.query_key_value": "self_attention.query_key_value",
    "attention.query_key_value": "self_attention.query_key_value",
    "self_attention.dense": "self_attention.dense",
    "attention.dense": "self_attention.dense",
    "post_attention_norm": "post_attention_layernorm",
    "post_attention_layernorm": "post_attention_layernorm",
    "mlp.dense_h_to_4h": "mlp.dense_h_to_4h",
    "mlp.dense_4h_to_h": "mlp.dense_4h_to_h",
}
# The linears megatron-core's local spec gives an ``_extra_state`` entry (None on CPU).
MCORE_LINEARS = [m for m in MCORE_LAYER if "linear" in m]
_LAYER_KEY = re.compile(r"(?:decoder|language_model\.(?:encoder|transformer))\.layers\.(\d+)\.(.+)")

State = dict[str, torch.Tensor]


# ---- names -------------------------------------------------------------------------------------


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Legacy state dicts nest (``language_model`` -> ``embedding`` -> ...): dotted keys."""
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def to_ours(key: str, where: str) -> str:
    """Our name for a megatron-core or legacy key (layer index unchanged)."""
    m = _LAYER_KEY.fullmatch(key)
    if m:
        index, rest = m.groups()
        if rest in TE_FUSED:
            return f"layers.{index}.{TE_FUSED[rest]}"
        module, _, param = rest.rpartition(".")
        table = MCORE_LAYER if key.startswith("decoder.") else LEGACY_LAYER
        if module in table and param in ("weight", "bias"):
            return f"layers.{index}.{table[module]}.{param}"
    fixed = {
        "embedding.word_embeddings.weight": WORD_EMBEDDING,
        "embedding.position_embeddings.weight": "embedding.position_embeddings.weight",
        "decoder.final_layernorm.weight": "final_layernorm.weight",
        "decoder.final_layernorm.bias": "final_layernorm.bias",
        "output_layer.weight": TIED_COPY,
        "word_embeddings_for_head.weight": TIED_COPY,
    }
    for enc in ("encoder", "transformer"):
        for norm in ("final_norm", "final_layernorm"):
            for p in ("weight", "bias"):
                fixed[f"language_model.{enc}.{norm}.{p}"] = f"final_layernorm.{p}"
    for p in ("word_embeddings", "position_embeddings"):
        fixed[f"language_model.embedding.{p}.weight"] = f"embedding.{p}.weight"
    if key in fixed:
        return fixed[key]
    hint = ""
    if key.startswith("language_model.output_layer"):
        hint = " (an untied output layer: zerotron's GPT ties it to the word embedding)"
    raise UnsupportedError(
        f"Megatron tensor {key!r} has no place in zerotron's GPT{hint}",
        where=where,
        fix="only GPT-2-style Megatron models convert",
    )


def _fix_legacy_qkv(t: torch.Tensor, version: float, heads: int) -> torch.Tensor:
    """Rows of a legacy version-0/1 QKV shard in our ``[heads, (q, k, v), d]`` order."""
    if version == 0:
        return qkv_blocks_to_heads(t, heads)
    rest = t.shape[1:]
    return t.reshape(heads, -1, 3, *rest).transpose(1, 2).reshape(t.shape).contiguous()


# ---- import ------------------------------------------------------------------------------------


def rank_states(
    files: Mapping[tuple[int, int], dict],
    tp: int,
    pp: int,
    heads: int,
    root: Path,
    uniform: int | None = None,
) -> tuple[dict[tuple[int, int], State], str, float]:
    """Each rank's state in our names with global layer indices; the layout and version.
    ``uniform``: the model's layer count, its stages' equal parts giving the layer offsets (the
    files may then be some stages' only); else the stages' own layer counts do."""
    per_chunk: dict[tuple[int, int, int], State] = {}
    kind = ""
    version = float(files[(0, 0)].get("checkpoint_version", CHECKPOINT_VERSION) or 0)
    # Megatron-DeepSpeed from its FPDT commit on: legacy version 0's QKV order, at version 3
    qkv_order = 0 if hasattr(files[(0, 0)].get("args"), FPDT_ARG) else version
    for (t, p), file in files.items():
        where = f"{root}/mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "")
        for c, chunk in enumerate(model_chunks(file, where)):
            flat = _flatten(chunk)
            kind = kind or ("legacy" if is_legacy(chunk) else "mcore")
            state = {}
            for key, value in flat.items():
                if key.endswith("_extra_state") or not torch.is_tensor(value):
                    continue
                ours = to_ours(key, where)
                if kind == "legacy" and qkv_order < 2 and ".query_key_value." in ours:
                    value = _fix_legacy_qkv(value, qkv_order, heads // tp)
                state[ours] = value
            per_chunk[(t, p, c)] = state
    # Local layer indices -> global: chunk-major, then stage (Megatron's interleaved order).
    chunks = 1 + max(c for _, _, c in per_chunk)

    def count(p: int, c: int) -> int:
        return len({k.split(".")[1] for k in per_chunk[(0, p, c)] if k.startswith("layers.")})

    offset, offsets = 0, {}
    bounds = partition_uniform(uniform, pp, chunks) if uniform else None
    for c in range(chunks):
        for p in range(pp):
            if bounds is None:
                offsets[(p, c)] = offset
                offset += count(p, c)
                continue
            offsets[(p, c)] = bounds[c * pp + p]
            size = bounds[c * pp + p + 1] - offsets[(p, c)]
            if (0, p, c) in per_chunk and count(p, c) != size:
                raise CheckpointError(
                    f"pipeline stage {p} holds {count(p, c)} layers, not the {size} of equal "
                    "stages",
                    where=str(root),
                )
    states: dict[tuple[int, int], State] = {}
    for (t, p, c), state in per_chunk.items():
        shifted = states.setdefault((t, p), {})
        for key, value in state.items():
            if key.startswith("layers."):
                _, i, rest = key.split(".", 2)
                key = f"layers.{int(i) + offsets[(p, c)]}.{rest}"
            shifted[key] = value
    return states, kind, version


# Megatron-LM's flags for pipeline stages of unequal layer counts: with any, read every stage.
UNEVEN_STAGES = (
    "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers",
    "num_layers_in_first_pipeline_stage",
    "num_layers_in_last_pipeline_stage",
    "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
    "pipeline_model_parallel_layout",
)


def _stages_holding(tag: Path, layers: Collection[int]) -> list[int] | None:
    """The pipeline stages of a Megatron-LM per-rank checkpoint whose files hold ``layers``
    (global indices), and the first (the word embedding, which every cut starts from); None
    (every stage) unless its args say the stages are equal parts."""
    file, loaded = args_file(tag)
    args = args_dict(loaded.get("args"), str(file))
    if any(args.get(key) for key in UNEVEN_STAGES):
        return None
    pp = int(args.get("pipeline_model_parallel_size") or 1)
    chunks = int(args.get("virtual_pipeline_model_parallel_size") or 1)
    num_layers = int(args["num_layers"])
    if num_layers % (pp * chunks):
        return None
    per_part = num_layers // (pp * chunks)
    return sorted({0} | {(i // per_part) % pp for i in layers})


_STACKED = "decoder.layers."
# The model's keys in a torch_dist directory (Megatron-LM saves its optimizer state beside them,
# under "optimizer.", which is not read).
MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.")


def _unstack_torch_dist(
    tensors: Mapping[str, torch.Tensor], where: str, first_layer: int = 0
) -> State:
    """torch_dist's stacked ``decoder.layers.X`` tensors (their layers from ``first_layer``
    on) split into ours per layer."""
    out: State = {}
    for key, t in tensors.items():
        if key.startswith(_STACKED):
            rest = key.removeprefix(_STACKED)
            for i in range(t.shape[0]):
                out[to_ours(f"{_STACKED}{first_layer + i}.{rest}", where)] = t[i].clone()
        else:
            out[to_ours(key, where)] = t
    return out


def _torch_dist_regions(
    tag: Path, tp: int, tensor_rank: int | None, layers: Collection[int] | None
) -> dict[str, mio.Region | None]:
    """The box of each of the model's global tensors holding tensor rank ``tensor_rank``'s
    shard (of ``tp``, the checkpoint's size: the rows Megatron's rank had; None: all ranks') of
    ``layers`` (the smallest range of them; None: all; the embedding and final LayerNorm too);
    None where nothing is cut."""
    regions: dict[str, mio.Region | None] = {}
    for key, shape in mio.torch_dist_shapes(tag).items():
        if not key.startswith(MODEL_PREFIXES):  # optimizer state saved beside the model
            continue
        offsets, sizes = [0] * len(shape), list(shape)
        stacked = key.startswith(_STACKED)
        ours = to_ours(f"{_STACKED}0.{key.removeprefix(_STACKED)}" if stacked else key, str(tag))
        if stacked and layers:
            offsets[0], sizes[0] = min(layers), max(layers) + 1 - min(layers)
        dim = partition_dim(ours)
        if tensor_rank is not None and dim is not None:
            dim += stacked
            sizes[dim] = shape[dim] // tp
            offsets[dim] = tensor_rank * sizes[dim]
        cut = offsets != [0] * len(shape)
        regions[key] = (tuple(offsets), tuple(sizes)) if cut or sizes != list(shape) else None
    return regions


def read_megatron(
    path: str | os.PathLike,
    tensor_rank: int | None = None,
    layers: Collection[int] | None = None,
) -> tuple[GPTConfig, State, dict[str, Any]]:
    """A Megatron-LM checkpoint as ours: ``(config, single-process state dict, info)``.

    ``path`` is a ``--save`` directory (its tracker picks the iteration), one ``iter_*``
    directory, or a ``torch_dist`` directory; or Megatron-DeepSpeed's ``--save`` directory or
    one ``global_step*`` in it. ``info`` says what was found: ``writer`` (Megatron-LM,
    Megatron-DeepSpeed), ``format`` (mcore, legacy, torch_dist; Megatron-DeepSpeed's
    pipeline-engine, no-pipeline-parallel), ``tensor_parallel``, ``pipeline_parallel``,
    ``iteration``, ``checkpoint_version``, ``tokenizer`` (our metadata's entry) and the
    samples Megatron had consumed (``consumed_train_samples``, ``consumed_valid_samples``, from
    its args).

    ``tensor_rank``: read only that tensor-parallel rank's part (its files; of a torch_dist
    directory, the rows of its tensors that rank saved) and return its shard of every layer,
    as the checkpoint's layout cut it. ``layers`` (torch_dist, and Megatron-DeepSpeed's pipeline
    engine): read only those transformer layers (global indices; of torch_dist, the smallest
    range holding them), besides the embedding and the final LayerNorm.
    """
    tag = mio.tag_dir(path)
    if mio.is_torch_dist(tag):
        tp = int(megatron_model_args(tag)[2]["tensor_model_parallel_size"])
        if tensor_rank is not None and not 0 <= tensor_rank < tp:
            raise ConfigError(f"tensor rank {tensor_rank} is outside 0..{tp - 1}", where=str(tag))
        regions = _torch_dist_regions(tag, tp, tensor_rank, layers)
        tensors, common = mio.read_torch_dist(tag, regions)
        args = args_dict(common.get("args"), str(tag / mio.COMMON_FILE))
        config = config_from_args(args, str(tag / mio.COMMON_FILE))
        state = _unstack_torch_dist(tensors, str(tag), min(layers) if layers else 0)
        if TIED_COPY in state:
            raise UnsupportedError(
                "the checkpoint has its own output layer (untied)",
                where=str(tag),
                fix="zerotron's GPT ties the output layer to the word embedding",
            )
        info = {
            "writer": "Megatron-LM",
            "format": "torch_dist",
            "tensor_parallel": args.get("tensor_model_parallel_size", 1),
            "pipeline_parallel": args.get("pipeline_model_parallel_size", 1),
            "iteration": common.get("iteration"),
            "checkpoint_version": common.get("checkpoint_version"),
        }
    else:
        writer = "Megatron-DeepSpeed" if is_megatron_deepspeed(tag) else "Megatron-LM"
        stages = None
        if writer == "Megatron-DeepSpeed":  # every tensor rank's files hold the whole depth
            files, tp, run_pp, kind = read_rank_files(tag, tensor_rank, layers)
            pp = 1
        else:
            stages = None if layers is None else _stages_holding(tag, layers)
            files, tp, pp = mio.read_rank_files(tag, tensor_rank, stages)
            run_pp, kind = pp, ""
        first = next(iter(files.values()))
        args = args_dict(first.get("args"), str(tag))
        config = config_from_args(args, f"{tag}: args")
        heads = config.num_attention_heads
        saved_tp = tp
        if tensor_rank is not None:  # one tensor rank's files: its shards, merged over stages
            files = {(0, p): file for (_, p), file in files.items()}
            heads, tp = heads // tp, 1
        uniform = config.num_layers if writer == "Megatron-LM" and stages is not None else None
        states, layout, version = rank_states(files, tp, pp, heads, tag, uniform)
        if pp == 1 and any(TIED_COPY in s for s in states.values()):
            raise UnsupportedError(
                "the checkpoint has an output layer beside the word embedding at pipeline size "
                "1 (untied)",
                where=str(tag),
                fix="zerotron's GPT ties the output layer to the word embedding",
            )
        if uniform:  # some stages' files: merged as the stages of a shorter pipeline
            rank = {p: i for i, p in enumerate(sorted({p for _, p in states}))}
            states = {(t, rank[p]): s for (t, p), s in states.items()}
            pp = len(rank)
        state = merge_model_shards(states, tp, pp, where=str(tag))
        info = {
            "writer": writer,
            "format": kind or layout,
            "tensor_parallel": saved_tp,
            "pipeline_parallel": run_pp,
            "iteration": first.get("iteration"),
            "checkpoint_version": version,
        }
    info["tokenizer"] = tokenizer_of(args)
    for key in ("consumed_train_samples", "consumed_valid_samples"):
        info[key] = int(args.get(key) or 0)
    if tensor_rank is None and layers is None:
        _check_shapes(state, config, str(tag))
    return config, state, info


def _check_shapes(state: State, config: GPTConfig, where: str) -> None:
    h, f, L = config.hidden_size, config.ffn_hidden_size, config.num_layers
    expected = {
        WORD_EMBEDDING: (config.vocab_size, h),
        "embedding.position_embeddings.weight": (config.max_position_embeddings, h),
        "final_layernorm.weight": (h,),
        "final_layernorm.bias": (h,),
    }
    for i in range(L):
        for name, shape in (
            ("input_layernorm.weight", (h,)),
            ("input_layernorm.bias", (h,)),
            ("self_attention.query_key_value.weight", (3 * h, h)),
            ("self_attention.query_key_value.bias", (3 * h,)),
            ("self_attention.dense.weight", (h, h)),
            ("self_attention.dense.bias", (h,)),
            ("post_attention_layernorm.weight", (h,)),
            ("post_attention_layernorm.bias", (h,)),
            ("mlp.dense_h_to_4h.weight", (f, h)),
            ("mlp.dense_h_to_4h.bias", (f,)),
            ("mlp.dense_4h_to_h.weight", (h, f)),
            ("mlp.dense_4h_to_h.bias", (h,)),
        ):
            expected[f"layers.{i}.{name}"] = shape
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    wrong = [
        f"{k} {tuple(state[k].shape)} (args say {v})"
        for k, v in expected.items()
        if k in state and tuple(state[k].shape) != v
    ]
    if missing or extra or wrong:
        raise CheckpointError(
            "the weights do not match the model the args describe: "
            + "; ".join(
                part
                for part in (
                    f"missing {missing[:6]}" if missing else "",
                    f"unexpected {extra[:6]}" if extra else "",
                    f"shapes {wrong[:4]}" if wrong else "",
                )
                if part
            ),
            where=where,
            fix="the checkpoint is incomplete, or its args are not the ones it was saved with",
        )


def read_megatron_as_ours(
    path: str | os.PathLike,
    tensor_rank: int | None = None,
    layers: Collection[int] | None = None,
) -> tuple[GPTConfig, State, dict[str, Any], dict[str, Any]]:
    """:func:`read_megatron` with the metadata a zerotron checkpoint of the model would have:
    ``(config, single-process state dict, metadata, what was found)``."""
    config, state, info = read_megatron(path, tensor_rank, layers)
    meta = build_metadata(
        model_config=config.to_dict(),
        vocab_size=config.orig_vocab_size,
        padded_vocab_size=config.vocab_size,
        tensor_model_parallel_size=info["tensor_parallel"],
        pipeline_model_parallel_size=info["pipeline_parallel"],
        tokenizer=info["tokenizer"],
    )
    return config, state, meta, info
