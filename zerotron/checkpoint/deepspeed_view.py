"""zerotron's ZeRO saves, readable by DeepSpeed's ``zero_to_fp32``.

DeepSpeed's reader (``deepspeed/utils/zero_to_fp32.py``, ``get_fp32_state_dict_from_zero_
checkpoint``) globs a tag directory for ``*_model_states.pt`` (buffers, ``param_shapes``,
``shared_params``, frozen parameters) and ``*_optim_states.pt`` (each rank's
``optimizer_state_dict`` with ``zero_stage``, ``partition_count`` and its fp32 groups).
zerotron's per-rank files ``zero_dp_rank_R_mp_rank_00_000_optim_states.pt`` already match the
second glob; :func:`deepspeed_view` gives each the ``optimizer_state_dict`` entry, whose fp32
groups are views of the masters already in the file (one group per parameter: rank R's chunk
of it), so nothing is stored twice, and returns the small model-states files to write beside
them (one model-parallel rank; the file formats are described in
:mod:`zerotron.checkpoint.deepspeed_format`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from zerotron.checkpoint.deepspeed_format import (
    FP32_GROUPS_3,
    FP32_GROUPS_12,
    MODEL_STATES,
    OSD,
    PARTITION_COUNT,
)

DS_VERSION = "0.0.0+zerotron"
"""``ds_version`` written into the view (DeepSpeed's reader only prints it)."""


def deepspeed_view(
    zero_state: dict[str, Any],
    *,
    dp_rank: int,
    buffers: Mapping[str, Tensor],
    shared_params: Mapping[str, str],
    frozen: Mapping[str, Tensor] | None,
) -> dict[str, Any] | None:
    """Add DeepSpeed's ``optimizer_state_dict`` entry to this rank's zerotron ZeRO file
    (``zero_state``, changed in place) and return the model-states file DeepSpeed's
    ``zero_to_fp32`` needs beside it: ``{file name: contents}`` (stages 1-2: from data-parallel
    rank 0 only, else empty; stage 3: one per rank), or None when it cannot be expressed
    (frozen parameters at stage 3, whose per-rank fragments zerotron does not keep).

    The fp32 groups are one per parameter, each this rank's chunk of it (a view of the masters
    in the file): concatenated over ranks, a chunk list gives the parameter followed by less
    than ``2 * dp`` padding elements, which DeepSpeed's stage 1-2 reader accepts, and is exactly
    its stage-3 layout (``ceil(n / dp)`` elements per rank).
    """
    stage = int(zero_state["zero_stage"])
    dp = int(zero_state["dp_size"])
    if stage == 3 and frozen:
        return None
    masters = zero_state["fp32_partitions"]
    chunks, shapes = [], []
    for e in zero_state["layout"]:
        flat = masters[int(e["partition"])].reshape(-1)
        offset, chunk = int(e["offset"]), int(e["chunk"])
        chunks.append(flat[offset : offset + chunk])
        shapes.append({e["name"]: torch.Size(e["shape"])})
    zero_state[OSD] = {
        "zero_stage": stage,
        PARTITION_COUNT: dp,
        FP32_GROUPS_3 if stage == 3 else FP32_GROUPS_12: chunks,
        "ds_version": DS_VERSION,
    }
    model_states: dict[str, Any] = {
        "module": {k: v for k, v in buffers.items()},
        "buffer_names": list(buffers),
        "param_shapes": shapes,
        "shared_params": dict(shared_params),
        "frozen_param_shapes": {},
        "frozen_param_fragments": {},
        "ds_version": DS_VERSION,
        "dp_world_size": dp,
        "mp_world_size": 1,
    }
    if stage < 3:
        if frozen:
            model_states["frozen_param_shapes"] = {n: t.shape for n, t in frozen.items()}
            model_states["frozen_param_fragments"] = dict(frozen)
        return {MODEL_STATES: model_states} if dp_rank == 0 else {}
    return {f"zero_pp_rank_{dp_rank}_mp_rank_00_model_states.pt": model_states}
