"""A GPT checkpoint as a model: build the model its metadata describes and load its weights.

Used by ``zerotron generate`` and ``zerotron convert``: the checkpoint's metadata.json carries
the shape, vocabulary and tokenizer, so no model flags need repeating.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from zerotron.checkpoint.layout import CHECKPOINT_VERSION, RELEASE_TAG, model_file
from zerotron.checkpoint.save_load import (
    build_metadata,
    load_file,
    read_metadata,
    resolve_tag,
    save_checkpoint,
)
from zerotron.checkpoint.state import load_model_state
from zerotron.errors import CheckpointError, UnsupportedError
from zerotron.models.gpt import GPT, VOCAB_PADDED_KEYS, GPTConfig


def load_gpt(
    load_dir: str | os.PathLike,
    tag: str | None = None,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> tuple[GPT, dict[str, Any]]:
    """The model a checkpoint holds (in eval mode) and its metadata.

    ``dtype`` defaults to the dtype the weights were saved in.
    """
    tag = resolve_tag(load_dir, tag)
    where = os.path.join(str(load_dir), tag)
    meta = read_metadata(load_dir, tag)
    layout = meta.get("layout", {})
    if (
        layout.get("tensor_model_parallel_size", 1) != 1
        or layout.get("pipeline_model_parallel_size", 1) != 1
    ):
        raise UnsupportedError(
            f"checkpoint layout {layout} is model-parallel",
            where=where,
            fix="this build loads tensor/pipeline size 1 checkpoints only",
        )
    if "model" not in meta:
        raise CheckpointError("metadata.json has no model config", where=where)
    config = GPTConfig.from_dict(meta["model"], where=f"{where}/metadata.json")
    state = load_file(load_dir, tag, model_file())["model"]
    model = GPT(config)
    load_model_state(
        model,
        state,
        vocab_keys=VOCAB_PADDED_KEYS,
        orig_vocab_size=meta.get("vocab", {}).get("size"),
        ckpt_config=meta["model"],
        where=where,
    )
    saved_dtype = next(iter(state.values())).dtype
    model.to(device=device, dtype=dtype or saved_dtype).eval()
    return model, meta


def save_gpt(
    save_dir: str | os.PathLike,
    config: GPTConfig,
    state_dict: dict[str, torch.Tensor],
    *,
    tag: str = RELEASE_TAG,
    tokenizer: dict[str, Any] | None = None,
    **extra: Any,
) -> str:
    """Write weights alone (no optimizer) in the checkpoint layout, as Megatron's "release"."""
    metadata = build_metadata(
        model_config=config.to_dict(),
        vocab_size=config.orig_vocab_size,
        padded_vocab_size=config.vocab_size,
        tokenizer=tokenizer or {"type": "GPT2BPETokenizer"},
        **extra,
    )
    files = {model_file(): {"model": state_dict, "checkpoint_version": CHECKPOINT_VERSION}}
    return str(save_checkpoint(save_dir, tag, files, metadata))
