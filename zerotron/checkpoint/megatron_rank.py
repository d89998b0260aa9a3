"""One rank of a zerotron run reading its part of a Megatron checkpoint (``pretrain --load``).

A rank reads only what it keeps where the checkpoint's layout allows, so that a run of many
ranks does not hold the whole model once per rank while it loads: see
:func:`megatron_weights_for`.
"""

from __future__ import annotations

import os
from typing import Any

from zerotron.checkpoint.megatron import State, read_megatron_as_ours
from zerotron.checkpoint.megatron_args import megatron_model_args
from zerotron.checkpoint.reshard import split_model_state, stage_layer_indices
from zerotron.errors import CheckpointError


def megatron_weights_for(
    path: str | os.PathLike,
    tp_rank: int,
    tp_size: int,
    pp_rank: int = 0,
    pp_size: int = 1,
    *,
    padded_vocab_size: int,
    virtual_stages: int = 1,
) -> tuple[State, dict[str, Any], dict[str, Any]]:
    """One rank's weights of a Megatron checkpoint, for a run of any layout: ``(weights of
    rank (tp_rank, pp_rank) of a (tp_size, pp_size) run with padded_vocab_size embedding rows,
    the metadata a zerotron checkpoint of this model would have, what was found)``.

    When the run has the checkpoint's tensor-parallel size and vocabulary padding, a rank reads
    only its tensor rank's part (Megatron-LM's and Megatron-DeepSpeed's per-rank files; of a
    torch_dist directory, the rows of each tensor that rank saved), else every tensor rank's;
    and of the pipeline only its stage's layers besides the embedding (and the final
    LayerNorm): the stages holding them (Megatron-LM's per-rank files, when its args give equal
    stages), those layers' own files (Megatron-DeepSpeed's pipeline engine) or the range of the
    stacked layer tensors holding them (torch_dist). A checkpoint whose stages turn out
    otherwise is read and merged whole (:func:`~zerotron.checkpoint.megatron.read_megatron`),
    so a rank then holds the whole model once while it loads.
    """
    saved, _, layout = megatron_model_args(path)
    layers = stage_layer_indices(saved.num_layers, pp_rank, pp_size, virtual_stages)
    same_tp = (
        layout["tensor_model_parallel_size"] == tp_size and saved.vocab_size == padded_vocab_size
    )
    try:
        config, part, meta, info = read_megatron_as_ours(path, tp_rank if same_tp else None, layers)
    except CheckpointError:  # stages not equal parts after all: read it whole below
        part = {}
    found = {int(k.split(".")[1]) for k in part if k.startswith("layers.")}
    if part and set(layers) <= found:
        t, tp = (0, 1) if same_tp else (tp_rank, tp_size)  # a shard already, or to cut
        own = split_model_state(
            part,
            t,
            tp,
            pp_rank,
            pp_size,
            orig_vocab_size=config.orig_vocab_size,
            padded_vocab_size=None if same_tp else padded_vocab_size,
            virtual_stages=virtual_stages,
            num_layers=saved.num_layers,
        )
        return own, meta, info
    config, state, meta, info = read_megatron_as_ours(path)
    weights = split_model_state(
        state,
        tp_rank,
        tp_size,
        pp_rank,
        pp_size,
        orig_vocab_size=config.orig_vocab_size,
        padded_vocab_size=padded_vocab_size,
        virtual_stages=virtual_stages,
    )
    return weights, meta, info
