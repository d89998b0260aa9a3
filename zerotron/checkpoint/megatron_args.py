"""What a Megatron checkpoint is, without its weights: its args as our GPT config and
tokenizer, who wrote it (Megatron-LM or Megatron-DeepSpeed) and in which format.

:mod:`zerotron.checkpoint.megatron` reads the weights. Every function here reads one file, the
one with Megatron's ``args`` (``common.pt``, DeepSpeed's model states or rank (0, 0)'s),
memory-mapped: its tensors are not read.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from zerotron.checkpoint import megatron_io as mio
from zerotron.checkpoint.layout import METADATA_FILE
from zerotron.checkpoint.load import read_latest_tag
from zerotron.checkpoint.megatron_deepspeed import has_layer_files, is_megatron_deepspeed
from zerotron.errors import CheckpointError, ConfigError, UnsupportedError
from zerotron.models.gpt import GPTConfig

# ---- args <-> config ---------------------------------------------------------------------------


def args_dict(args: Any, where: str) -> dict[str, Any]:
    if isinstance(args, argparse.Namespace):
        return vars(args)
    if isinstance(args, Mapping):
        return dict(args)
    raise CheckpointError(
        "the checkpoint has no Megatron 'args'",
        where=where,
        fix="zerotron reads the model's shape from the args Megatron-LM saves; re-save with it",
    )


def config_from_args(args: Mapping[str, Any], where: str) -> GPTConfig:
    """Our GPT config for Megatron-LM's ``args``; refuses what our GPT cannot represent."""
    differs = []

    def want(key: str, ok: Any, expected: str) -> None:
        value = args.get(key)
        if value is not None and not ok(value):
            differs.append(f"{key}={value!r} (zerotron's GPT: {expected})")

    want("swiglu", lambda v: not v, "GELU MLP, no SwiGLU")
    want("normalization", lambda v: str(v).lower() == "layernorm", "LayerNorm")
    want("position_embedding_type", lambda v: v == "learned_absolute", "learned positions")
    want("use_rotary_position_embeddings", lambda v: not v, "no rotary embeddings")
    want("untie_embeddings_and_output_weights", lambda v: not v, "tied output layer")
    want("add_bias_linear", lambda v: v, "linear layers with biases")
    want("apply_residual_connection_post_layernorm", lambda v: not v, "pre-LayerNorm residual")
    want("apply_layernorm_1p", lambda v: not v, "plain LayerNorm weights")
    want("qk_layernorm", lambda v: not v, "no QK LayerNorm")
    # Megatron-DeepSpeed's is a list of experts per layer group, [1] when dense
    want("num_experts", lambda v: not v or v == [1], "dense MLP")
    want("squared_relu", lambda v: not v, "GELU")
    heads, hidden = args.get("num_attention_heads"), args.get("hidden_size")
    if args.get("group_query_attention") and args.get("num_query_groups") != heads:
        differs.append(
            f"num_query_groups={args.get('num_query_groups')} (zerotron's GPT: one key/value "
            f"head per query head, {heads})"
        )
    if args.get("num_key_value_heads") not in (None, heads):  # Megatron-DeepSpeed's GQA
        differs.append(
            f"num_key_value_heads={args['num_key_value_heads']} (zerotron's GPT: {heads})"
        )
    if heads and hidden and args.get("kv_channels") not in (None, hidden // heads):
        differs.append(f"kv_channels={args['kv_channels']} (zerotron's GPT: hidden/heads)")
    # Megatron's GELU is the tanh approximation with --openai-gelu or the fused bias-GELU
    # (--bias-gelu-fusion, on by default); otherwise it is erf GELU, which ours is not.
    if not args.get("openai_gelu") and not args.get("bias_gelu_fusion", True):
        differs.append("GELU (erf) without --openai-gelu or --bias-gelu-fusion (zerotron: tanh)")
    if differs:
        raise UnsupportedError(
            "the Megatron model differs from what zerotron's GPT can represent: "
            + "; ".join(differs),
            where=where,
            fix="only GPT-2-style models (LayerNorm, GELU, learned positions, tied embeddings) "
            "convert",
        )
    padded = args.get("padded_vocab_size")
    if padded is None:
        raise CheckpointError("args lack padded_vocab_size", where=where)
    orig = orig_vocab_size(args, int(padded))
    seq = args.get("seq_length") or args.get("max_position_embeddings")
    try:
        return GPTConfig(
            num_layers=int(args["num_layers"]),
            hidden_size=int(hidden),
            num_attention_heads=int(heads),
            ffn_hidden_size=args.get("ffn_hidden_size"),
            seq_length=int(seq),
            max_position_embeddings=args.get("max_position_embeddings") or int(seq),
            vocab_size=int(padded),
            orig_vocab_size=int(orig),
            layernorm_epsilon=float(args.get("norm_epsilon", args.get("layernorm_epsilon", 1e-5))),
            init_method_std=float(args.get("init_method_std", 0.02)),
            hidden_dropout=float(args.get("hidden_dropout", 0.1)),
            attention_dropout=float(args.get("attention_dropout", 0.1)),
        )
    except (KeyError, TypeError, ValueError, ConfigError) as e:
        raise CheckpointError(f"args do not describe a usable GPT: {e}", where=where) from None


def orig_vocab_size(args: Mapping[str, Any], padded: int) -> int:
    """The tokenizer's vocabulary, which Megatron's args give only indirectly: ``--vocab-size``
    (NullTokenizer adds its EOD id to it), GPT-2's BPE (50257), else the padded size."""
    tokenizer, size = args.get("tokenizer_type"), args.get("vocab_size")
    if args.get("orig_vocab_size"):  # what zerotron's export records
        return int(args["orig_vocab_size"])
    if size:
        return int(size) + (tokenizer == "NullTokenizer")
    if tokenizer == "GPT2BPETokenizer" and padded >= 50257:
        return 50257
    return padded


def tokenizer_of(args: Mapping[str, Any]) -> dict[str, Any]:
    """The tokenizer entry of our metadata for Megatron's args."""
    tok = {"type": args.get("tokenizer_type") or "GPT2BPETokenizer"}
    for key in ("vocab_file", "merge_file", "vocab_size"):
        if args.get(key) is not None:
            tok[key] = args[key]
    return tok


# ---- what it is ------------------------------------------------------------------------------


def model_chunks(file: Mapping[str, Any], where: str) -> list[dict[str, Any]]:
    if "model" in file:
        return [file["model"]]
    chunks = sorted((k for k in file if re.fullmatch(r"model\d+", k)), key=lambda k: int(k[5:]))
    if not chunks:
        raise CheckpointError("no 'model' entry", where=where)
    return [file[k] for k in chunks]


def is_legacy(chunk: Mapping[str, Any]) -> bool:
    return "language_model" in chunk or any(k.startswith("language_model.") for k in chunk)


def is_megatron_checkpoint(load_dir: str | os.PathLike) -> bool:
    """Whether the tag a ``--load`` directory's tracker names holds a checkpoint Megatron-LM
    wrote (megatron-core's ``torch_dist`` directory, or ``mp_rank_*`` files without zerotron's
    metadata.json) or Megatron-DeepSpeed did."""
    tag = read_latest_tag(load_dir)
    if tag is None or not (Path(load_dir) / tag).is_dir():
        return False
    path = Path(load_dir) / tag
    return (
        mio.is_torch_dist(path)
        or (bool(mio.rank_dirs(path)) and not (path / METADATA_FILE).is_file())
        or is_megatron_deepspeed(path)
    )


def megatron_writer(load_dir: str | os.PathLike) -> str:
    """Who wrote the Megatron checkpoint a ``--load`` directory's tracker names:
    "Megatron-DeepSpeed" or "Megatron-LM"."""
    tag = read_latest_tag(load_dir)
    deepspeed = tag is not None and is_megatron_deepspeed(Path(load_dir) / tag)
    return "Megatron-DeepSpeed" if deepspeed else "Megatron-LM"


def args_file(tag: Path) -> tuple[Path, dict[str, Any]]:
    """The file that holds a Megatron checkpoint's args (``common.pt``, DeepSpeed's model
    states, or rank (0, 0)'s file), loaded memory-mapped: its tensors are not read."""
    if mio.is_torch_dist(tag):
        file = tag / mio.COMMON_FILE
    elif is_megatron_deepspeed(tag):
        file = tag / mio.DEEPSPEED_MODEL_STATES
    else:
        file = mio.rank_dirs(tag).get((0, 0), tag / "mp_rank_00" / mio.MODEL_FILE)
    if not file.is_file():
        raise CheckpointError("the file with Megatron's args is missing", where=str(file))
    loaded = mio.load_safe(file, mmap=True)
    return file, loaded if isinstance(loaded, dict) else {}


def megatron_model_args(
    path: str | os.PathLike,
) -> tuple[GPTConfig, dict[str, Any], dict[str, int]]:
    """The model, the tokenizer entry (our metadata's) and the tensor/pipeline sizes (our
    metadata's layout entry) a Megatron checkpoint's args describe; reads one file's args, not
    the weights."""
    file, loaded = args_file(mio.tag_dir(path))
    args = args_dict(loaded.get("args"), str(file))
    layout = {
        name: int(args.get(name) or 1)
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size")
    }
    return config_from_args(args, f"{file}: args"), tokenizer_of(args), layout


def describe_megatron(path: str | os.PathLike) -> dict[str, Any] | None:
    """What a Megatron checkpoint is, from one file's args (memory-mapped; for ``zerotron
    checkpoint info``): its directory, ``writer``, ``format``, ``config``, ``tokenizer``,
    ``iteration``, the run's ``tensor_parallel`` / ``pipeline_parallel`` / ``virtual_pipeline``
    / ``data_parallel`` sizes and ``consumed_train_samples``; None when the file holds no
    Megatron args (an ``argparse.Namespace``)."""
    tag = mio.tag_dir(path)
    file, loaded = args_file(tag)
    if not isinstance(loaded.get("args"), argparse.Namespace):
        return None  # not Megatron's args: a zerotron checkpoint that lost its metadata.json?
    args = vars(loaded["args"])
    if mio.is_torch_dist(tag):
        writer, kind = "Megatron-LM", "torch_dist"
    elif is_megatron_deepspeed(tag):
        writer = "Megatron-DeepSpeed"
        # the layer files, when there are any, are what is read
        kind = "pipeline-engine" if has_layer_files(tag) else "no-pipeline-parallel"
    else:
        chunks = model_chunks(loaded, str(file))
        writer, kind = "Megatron-LM", "legacy" if is_legacy(chunks[0]) else "mcore"
    return {
        "directory": tag,
        "writer": writer,
        "format": kind,
        "config": config_from_args(args, f"{file}: args"),
        "tokenizer": tokenizer_of(args),
        "iteration": loaded.get("iteration"),
        "tensor_parallel": int(args.get("tensor_model_parallel_size") or 1),
        "pipeline_parallel": int(args.get("pipeline_model_parallel_size") or 1),
        "virtual_pipeline": int(args.get("virtual_pipeline_model_parallel_size") or 1),
        "data_parallel": args.get("data_parallel_size"),
        "consumed_train_samples": int(args.get("consumed_train_samples") or 0),
    }
