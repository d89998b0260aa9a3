"""A GPT checkpoint as a model: build the model its metadata describes and load its weights.

Used by ``zerotron generate`` and ``zerotron convert``: the checkpoint's metadata.json carries
the shape, vocabulary, tokenizer and layout, so no model flags need repeating, and a checkpoint
of any tensor/pipeline layout loads (merged, then split for this run's tensor-parallel rank).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from zerotron.checkpoint.layout import CHECKPOINT_VERSION, RELEASE_TAG, model_file
from zerotron.checkpoint.reshard import (
    load_model_state_for,
    orig_vocab_size_of,
    split_model_state,
    target_padded_vocab_size,
)
from zerotron.checkpoint.save_load import (
    build_metadata,
    read_metadata,
    resolve_tag,
    save_checkpoint,
)
from zerotron.checkpoint.state import load_model_state, refuse_non_finite
from zerotron.distributed.comm import Group
from zerotron.distributed.state import state
from zerotron.errors import CheckpointError
from zerotron.models.gpt import GPT, VOCAB_PADDED_KEYS, GPTConfig


def load_gpt(
    load_dir: str | os.PathLike,
    tag: str | None = None,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    tp_group: Group | None = None,
) -> tuple[GPT, dict[str, Any]]:
    """The model a checkpoint holds (in eval mode, without pipeline stages) and its metadata.

    The checkpoint may have any tensor/pipeline layout: its files are merged
    (:mod:`zerotron.checkpoint.reshard`) and, when ``tp_group`` (default: the current
    ``state().tp``) has more than one rank, this rank's tensor-parallel shard is kept. The
    vocabulary keeps the saved padding when it splits over the group, else it is padded as
    Megatron pads for that size. Sequence parallelism is off (generation feeds one position at
    a time). ``dtype`` defaults to the dtype the weights were saved in. A Megatron-LM ``--save``
    directory (no ``tag``) is read as ``zerotron convert --from-megatron`` reads it; the
    metadata returned is what its conversion would record.
    """
    from zerotron.checkpoint.megatron import read_megatron_as_ours
    from zerotron.checkpoint.megatron_args import is_megatron_checkpoint

    group = state().tp if tp_group is None else tp_group
    if tag is None and is_megatron_checkpoint(load_dir):  # Megatron-LM's own files
        where = str(load_dir)
        config, full, meta, _ = read_megatron_as_ours(load_dir)
        rows = _rows(config, meta, group)
        weights = split_model_state(
            full,
            group.rank,
            group.size,
            orig_vocab_size=config.orig_vocab_size,
            padded_vocab_size=rows,
        )
    else:
        tag = resolve_tag(load_dir, tag)
        where = os.path.join(str(load_dir), tag)
        meta = read_metadata(load_dir, tag)
        if "model" not in meta:
            raise CheckpointError("metadata.json has no model config", where=where)
        config = GPTConfig.from_dict(meta["model"], where=f"{where}/metadata.json")
        rows = _rows(config, meta, group)
        weights, _ = load_model_state_for(
            load_dir, tag, group.rank, group.size, 0, 1, padded_vocab_size=rows
        )
    config = dataclasses.replace(config, vocab_size=rows, sequence_parallel=False)
    refuse_non_finite(weights, where, "model")
    model = GPT(config, tp_group=group)
    load_model_state(
        model,
        weights,
        vocab_keys=VOCAB_PADDED_KEYS,
        orig_vocab_size=orig_vocab_size_of(meta),
        ckpt_config=meta["model"],
        where=where,
    )
    saved_dtype = next(iter(weights.values())).dtype
    model.to(device=device, dtype=dtype or saved_dtype).eval()
    return model, meta


def _rows(config: GPTConfig, meta: dict[str, Any], group: Group) -> int:
    """The embedding rows for ``group``: the saved padding when it splits over the group, else
    the vocabulary padded as Megatron pads for that size."""
    if config.vocab_size % group.size:
        return target_padded_vocab_size(meta, group.size)
    return config.vocab_size


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
