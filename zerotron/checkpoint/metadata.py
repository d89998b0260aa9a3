"""A checkpoint's metadata.json: read it and check the types of the entries tools rely on.

What metadata.json holds is described in docs/checkpoints.md; it is written by
:func:`zerotron.checkpoint.save_load.commit_tag`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from zerotron.checkpoint import layout
from zerotron.errors import CheckpointError


def foreign_checkpoint(tag_dir: str | os.PathLike) -> CheckpointError | None:
    """The error for a tag directory that another tool wrote (Megatron-LM, Megatron-DeepSpeed,
    DeepSpeed), saying what reads it; None when it is not one of theirs."""
    from zerotron.checkpoint import megatron_io
    from zerotron.checkpoint.deepspeed_format import is_deepspeed_tag
    from zerotron.checkpoint.megatron_deepspeed import is_megatron_deepspeed

    tag_dir = Path(tag_dir)
    if not tag_dir.is_dir():
        return None
    megatron = (
        "`zerotron pretrain --load DIR --finetune` (or --no-load-optim --no-load-rng) and "
        "`zerotron generate --load DIR` take it as it is; `zerotron convert --from-megatron DIR "
        "--save CKPT` makes a zerotron checkpoint of it for the other commands"
    )
    if megatron_io.is_torch_dist(tag_dir):
        return CheckpointError(
            "the checkpoint was written by Megatron-LM (torch_dist), not by zerotron",
            where=str(tag_dir),
            fix=megatron,
        )
    if megatron_io.rank_dirs(tag_dir) and not (tag_dir / layout.METADATA_FILE).is_file():
        # zerotron's own layout is Megatron's too: only its metadata.json tells them apart
        return CheckpointError(
            "the checkpoint has no metadata.json: its mp_rank_* files are laid out as Megatron-LM "
            "writes them",
            where=str(tag_dir),
            fix=f"if Megatron-LM wrote it, {megatron}; if zerotron did, restore its "
            "metadata.json (docs/checkpoints.md)",
        )
    if is_megatron_deepspeed(tag_dir):
        return CheckpointError(
            "the checkpoint was written by Megatron-DeepSpeed, not by zerotron",
            where=str(tag_dir),
            fix=megatron,
        )
    if is_deepspeed_tag(tag_dir):
        return CheckpointError(
            "the checkpoint was written by DeepSpeed, not by zerotron",
            where=str(tag_dir),
            fix="a script with `import zerotron as deepspeed` loads it with "
            "engine.load_checkpoint(DIR); zerotron.utils.zero_to_fp32."
            "get_fp32_state_dict_from_zero_checkpoint(DIR) gives its weights",
        )
    return None


def read_metadata(load_dir: str | os.PathLike, tag: str) -> dict[str, Any]:
    """The metadata.json of a checkpoint."""
    root = layout.tag_dir(load_dir, tag)
    path = root / layout.METADATA_FILE
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise foreign_checkpoint(root) or CheckpointError(
            "the checkpoint has no metadata.json (was it written by another tool?)",
            where=str(path),
            fix="zerotron reads the model shape and vocabulary from it: use a checkpoint saved "
            "by zerotron (HuggingFace weights: `zerotron convert --from-hf DIR --save CKPT`), or "
            "write metadata.json as docs/checkpoints.md describes",
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(
            f"metadata.json is not valid JSON: {str(e)[:200]}",
            where=str(path),
            fix="restore it from a backup or re-create the checkpoint",
        ) from None
    if isinstance(meta, dict) and "sharded_backend" in meta:  # megatron-core's own metadata.json
        raise foreign_checkpoint(root) or CheckpointError(
            "metadata.json is megatron-core's, not zerotron's", where=str(path)
        )
    check_metadata(meta, str(path))
    return meta


# Each known metadata.json entry: the JSON type it must have (None allowed where listed).
_META_TYPES: dict[str, tuple[type, ...]] = {
    "layout": (dict,),
    "model": (dict,),
    "vocab": (dict,),
    "tokenizer": (dict,),
    "files": (list,),
    "versions": (dict,),
    "tag": (str,),
    "iteration": (int, type(None)),
    "format_version": (int,),
    "checksums": (dict,),
}
_META_INTS = {
    "layout": (
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "data_parallel_size",
        "zero_stage",
    ),
    "vocab": ("size", "padded_size"),
}


def _json_type(value: Any) -> str:
    names = {
        dict: "an object",
        list: "a list",
        str: "a string",
        bool: "true/false",
        int: "an integer",
        float: "a number",
    }
    return names.get(type(value), "null" if value is None else f"a {type(value).__name__}")


def check_metadata(meta: Any, where: str) -> None:
    """Refuse a metadata.json whose entries have the wrong JSON types (a string where a number
    is expected, a list where an object is), naming the key: tools read them without checking.
    """

    def bad(key: str, value: Any, want: str) -> CheckpointError:
        return CheckpointError(
            f"metadata.json: {key} is {_json_type(value)} ({str(value)[:60]}), expected {want}",
            where=where,
            fix="correct that entry (docs/checkpoints.md describes metadata.json), or restore "
            "the file from a backup",
        )

    if not isinstance(meta, dict):
        raise bad("the top level", meta, "an object")
    for key, types in _META_TYPES.items():
        value = meta.get(key)
        if key in meta and not (isinstance(value, types) and not isinstance(value, bool)):
            want = " or ".join(_json_type(t()) if t is not type(None) else "null" for t in types)
            raise bad(key, value, want)
    for section, keys in _META_INTS.items():
        for key in keys:
            value = (meta.get(section) or {}).get(key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise bad(f"{section}.{key}", value, "an integer")
            if value is not None and value < (0 if key == "zero_stage" else 1):
                raise bad(f"{section}.{key}", value, "a positive integer")
    files = meta.get("files") or []
    if not all(isinstance(f, str) for f in files):
        raise bad("files", files, "a list of file names")
