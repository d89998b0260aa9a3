"""What a checkpoint holds, without loading it: ``zerotron checkpoint info``.

Layout (tensor, pipeline, virtual pipeline, data parallel sizes, ZeRO stage, offload), model
shape, iteration and training progress, the size of every file, and the layouts it can be
converted to (the targets ``zerotron convert`` and a resume on another layout accept). Reads
metadata.json and, for the counters, the first model file memory-mapped (its tensors are not
read).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from zerotron.checkpoint import layout
from zerotron.checkpoint.megatron_args import describe_megatron, is_megatron_checkpoint
from zerotron.checkpoint.megatron_deepspeed_optim import optimizer_files
from zerotron.checkpoint.metadata import read_metadata
from zerotron.checkpoint.save_load import read_latest_tag
from zerotron.checkpoint.verify import (
    expected_files,
    holds_zero_state,
    layout_sizes,
    tags_newest_first,
)
from zerotron.errors import CheckpointError
from zerotron.fileio import human_bytes

# Counters a zerotron model file carries (the training loop's client state and the Engine's).
_PROGRESS_KEYS = ("iteration", "consumed_train_samples", "global_steps", "global_samples")
_SHAPE_KEYS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "ffn_hidden_size",
    "seq_length",
    "max_position_embeddings",
)
MAX_TP_LISTED = 64  # tensor-parallel targets are listed up to this size


def _find(tree: Any, key: str) -> Any:
    """The first value under ``key`` anywhere in nested dicts (a saved config's sections)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, Mapping):
            if key in node and not isinstance(node[key], Mapping):
                return node[key]
            stack.extend(v for v in node.values() if isinstance(v, Mapping))
    return None


def _model_file_entries(root: Path, meta: Mapping[str, Any]) -> dict[str, Any]:
    """The non-tensor entries of the first model file (memory-mapped: tensors stay on disk)."""
    files = expected_files(meta) or [layout.model_file()]
    path = root / files[0]
    if not path.is_file():
        return {}
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 (info reports what it can; verify names a bad file)
        return {}
    return saved if isinstance(saved, dict) else {}


def divisors(n: int, limit: int | None = None) -> list[int]:
    """The divisors of ``n`` (up to ``limit``), ascending."""
    return [d for d in range(1, (limit or n) + 1) if n % d == 0]


def conversion_targets(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The tensor and pipeline sizes this checkpoint's model can be laid out for.

    Tensor parallel: sizes dividing the attention heads, the query groups and the FFN width (the
    vocabulary is re-padded to ``make_vocab_size_divisible_by × tp``, so it does not limit).
    Pipeline: sizes up to the layer count; those dividing it give equal stages (others give the
    earlier stages one layer more). Data-parallel size and ZeRO stage 0-3 are free.
    """
    model = meta.get("model") or {}
    heads, layers = model.get("num_attention_heads"), model.get("num_layers")
    out: dict[str, Any] = {"data_parallel_size": "any", "zero_stage": [0, 1, 2, 3]}
    if isinstance(heads, int) and heads > 0:
        limit = min(heads, MAX_TP_LISTED)
        hidden = model.get("hidden_size") or 0
        ffn = model.get("ffn_hidden_size") or 4 * hidden
        groups = model.get("num_query_groups") or heads
        out["tensor_model_parallel_size"] = [
            t for t in divisors(heads, limit) if ffn % t == 0 and groups % t == 0
        ]
    if isinstance(layers, int) and layers > 0:
        out["pipeline_model_parallel_size"] = divisors(layers)
    return out


def megatron_checkpoint_info(described: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`checkpoint_info`'s description of a checkpoint Megatron-LM or Megatron-DeepSpeed
    wrote (:func:`~zerotron.checkpoint.megatron_args.describe_megatron`): its writer and format, the
    run's layout, model, vocabulary, progress and files, and the zerotron commands that read it
    (into any layout: the weights are cut for the run's)."""
    root, config = Path(described["directory"]), described["config"]
    model = config.to_dict()
    seq = model.get("seq_length")
    progress: dict[str, Any] = {"iteration": described["iteration"]}
    samples = described["consumed_train_samples"]
    if samples:
        progress["consumed_train_samples"] = samples
        if isinstance(seq, int):
            progress["consumed_train_tokens"] = samples * seq
    files = [
        {"path": p.relative_to(root).as_posix(), "size": p.stat().st_size}
        for p in sorted(root.rglob("*"))
        if p.is_file()
    ]
    return {
        "directory": str(root),
        "tag": root.name,
        "iteration": described["iteration"],
        "writer": described["writer"],
        "format": described["format"],
        "layout": {
            "tensor_model_parallel_size": described["tensor_parallel"],
            "pipeline_model_parallel_size": described["pipeline_parallel"],
            "virtual_pipeline_model_parallel_size": described["virtual_pipeline"],
            "data_parallel_size": described["data_parallel"],
        },
        "model": {k: model[k] for k in _SHAPE_KEYS if model.get(k) is not None},
        "vocab": {"size": config.orig_vocab_size, "padded_size": config.vocab_size},
        "tokenizer": described["tokenizer"],
        "progress": progress,
        "files": files,
        "total_size": sum(f["size"] for f in files),
        "optimizer_partitions": described["writer"] == "Megatron-DeepSpeed"
        and bool(optimizer_files(root)),
        "read_by": list(MEGATRON_READERS),
    }


# The zerotron commands that take a Megatron checkpoint as it is (DIR: its --save directory).
MEGATRON_READERS = (
    "zerotron pretrain --load DIR --finetune (or --no-load-optim --no-load-rng), any layout",
    "zerotron generate --load DIR",
    "zerotron convert --from-megatron DIR --save CKPT (a zerotron checkpoint of it)",
)


def checkpoint_info(load_dir: str | os.PathLike, tag: str | None = None) -> dict[str, Any]:
    """A JSON-ready description of ``<load_dir>/<tag>`` (default: the trackers' tag, else the
    newest one there); see the module docstring. A checkpoint Megatron-LM or Megatron-DeepSpeed
    wrote is described from its args (:func:`megatron_checkpoint_info`)."""
    if tag is None and is_megatron_checkpoint(load_dir):
        try:
            described = describe_megatron(load_dir)
        except CheckpointError:  # unreadable as Megatron's: read_metadata below says whose
            described = None
        if described is not None:
            return megatron_checkpoint_info(described)
    if tag is None:
        tag = read_latest_tag(load_dir)
        if tag is None:
            found = tags_newest_first(load_dir)
            if not found:
                raise CheckpointError(
                    "no checkpoint here: no tracker file and no tag directory with a metadata.json",
                    where=str(load_dir),
                    fix="pass the directory given to --save",
                )
            tag = found[0]
    root = layout.tag_dir(load_dir, tag)
    meta = read_metadata(load_dir, tag)
    saved = _model_file_entries(root, meta)
    args = saved.get("args") if isinstance(saved.get("args"), Mapping) else {}
    lay = meta.get("layout") or {}
    tp, pp, dp, stage = layout_sizes(meta)

    def setting(key: str, default: Any) -> Any:
        value = lay.get(key)
        if value is None:
            value = _find(args, key)
        return default if value is None else value

    model = meta.get("model") or {}
    seq = model.get("seq_length")
    progress = {k: saved[k] for k in _PROGRESS_KEYS if isinstance(saved.get(k), int)}
    if "consumed_train_samples" in progress and isinstance(seq, int):
        progress["consumed_train_tokens"] = progress["consumed_train_samples"] * seq
    files = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        files.append({"path": path.relative_to(root).as_posix(), "size": path.stat().st_size})
    return {
        "directory": str(root),
        "tag": tag,
        "iteration": meta.get("iteration"),
        "layout": {
            "tensor_model_parallel_size": tp,
            "pipeline_model_parallel_size": pp,
            "virtual_pipeline_model_parallel_size": setting(
                "virtual_pipeline_model_parallel_size", 1
            ),
            "data_parallel_size": dp,
            "zero_stage": stage,
            "offload_optimizer": setting("offload_optimizer_device", "none"),
            "offload_param": setting("offload_param_device", "none"),
            "optimizer_states": holds_zero_state(meta)
            or (stage == 0 and "optimizer" in saved and meta.get("optimizer_states") is not False),
        },
        "model": {k: model[k] for k in _SHAPE_KEYS if model.get(k) is not None},
        "vocab": dict(meta.get("vocab") or {}),
        "progress": progress,
        "checksums": isinstance(meta.get("checksums"), dict),
        "files": files,
        "total_size": sum(f["size"] for f in files),
        "convert_to": conversion_targets(meta),
        "versions": dict(meta.get("versions") or {}),
        "saved_at": meta.get("saved_at"),
    }


def _format_megatron_info(info: Mapping[str, Any]) -> str:
    lay, model, prog = info["layout"], info["model"], info["progress"]
    lines = [
        f"{info['writer']} {info['format']} checkpoint {info['directory']}  (tag {info['tag']}, "
        f"iteration {info['iteration']})"
    ]
    dp = lay["data_parallel_size"]
    lines.append(
        f"  layout      tensor {lay['tensor_model_parallel_size']} x pipeline "
        f"{lay['pipeline_model_parallel_size']} (virtual "
        f"{lay['virtual_pipeline_model_parallel_size']})"
        + (f" x data {dp}" if dp else "")
        + (
            "; its optimizer state is in DeepSpeed's partitions, which `zerotron pretrain "
            "--load` and `zerotron convert --from-megatron` carry (its RNG states are not read)"
            if info.get("optimizer_partitions")
            else f"; its optimizer and RNG states are {info['writer']}'s (zerotron reads the "
            "weights)"
        )
    )
    lines.append("  model       " + ", ".join(f"{k} {v}" for k, v in model.items()))
    vocab, tok = info["vocab"], info["tokenizer"]
    lines.append(
        f"  vocabulary  {vocab['size']} (padded to {vocab['padded_size']}), {tok.get('type')}"
    )
    lines.append("  progress    " + ", ".join(f"{k} {v}" for k, v in prog.items()))
    lines.append(f"  files       {len(info['files'])}, {human_bytes(info['total_size'])} in all")
    width = max((len(f["path"]) for f in info["files"]), default=0)
    for f in info["files"]:
        lines.append(f"    {f['path']:<{width}}  {human_bytes(f['size']):>10}")
    lines.append("  read by")
    lines.extend(f"    {reader}" for reader in info["read_by"])
    return "\n".join(lines)


def format_info(info: Mapping[str, Any]) -> str:
    """``checkpoint_info``'s result as the text ``zerotron checkpoint info`` prints."""
    if "writer" in info:
        return _format_megatron_info(info)
    lay, model, prog, conv = info["layout"], info["model"], info["progress"], info["convert_to"]
    lines = [f"checkpoint {info['directory']}  (tag {info['tag']}, iteration {info['iteration']})"]
    vpp = lay["virtual_pipeline_model_parallel_size"]
    lines.append(
        f"  layout      tensor {lay['tensor_model_parallel_size']} x pipeline "
        f"{lay['pipeline_model_parallel_size']} (virtual {vpp}) x data "
        f"{lay['data_parallel_size']}, ZeRO stage {lay['zero_stage']}, offload optimizer "
        f"{lay['offload_optimizer']}, param {lay['offload_param']}; optimizer states "
        f"{'saved' if lay['optimizer_states'] else 'not saved'}"
    )
    if model:
        lines.append("  model       " + ", ".join(f"{k} {v}" for k, v in model.items()))
    vocab = info["vocab"]
    if vocab:
        lines.append(f"  vocabulary  {vocab.get('size')} (padded to {vocab.get('padded_size')})")
    if prog:
        lines.append("  progress    " + ", ".join(f"{k} {v}" for k, v in prog.items()))
    lines.append(
        f"  files       {len(info['files'])}, {human_bytes(info['total_size'])} in all"
        f" ({'with' if info['checksums'] else 'no'} checksums)"
    )
    width = max((len(f["path"]) for f in info["files"]), default=0)
    for f in info["files"]:
        lines.append(f"    {f['path']:<{width}}  {human_bytes(f['size']):>10}")
    lines.append("  convert to")
    if "tensor_model_parallel_size" in conv:
        sizes = ", ".join(map(str, conv["tensor_model_parallel_size"]))
        lines.append(f"    tensor parallel    {sizes}")
    if "pipeline_model_parallel_size" in conv:
        sizes = ", ".join(map(str, conv["pipeline_model_parallel_size"]))
        lines.append(f"    pipeline parallel  {sizes} (equal stages; any size up to num_layers)")
    lines.append("    data parallel      any; ZeRO stage 0-3, with or without offload")
    return "\n".join(lines)
