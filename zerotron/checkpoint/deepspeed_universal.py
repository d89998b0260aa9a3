"""DeepSpeed's universal checkpoints: read what ``ds_to_universal.py`` writes into the same
:class:`~zerotron.checkpoint.deepspeed_format.DeepSpeedCheckpoint` the ZeRO reader gives, so
an engine of any ZeRO stage and data-parallel size loads it the same way.

A DeepSpeed user converts a ZeRO checkpoint with
``python ds_to_universal.py --input_folder ckpt/global_step3 --output_folder
ckpt/global_step3_universal`` and loads it with ``"checkpoint": {"load_universal": true}``.
What the script writes (DeepSpeed 0.19, one model-parallel rank)::

    <dir>/latest_universal                      the universal tag (the output folder's name)
    <dir>/<tag>/mp_rank_00_model_states.pt      stages 1-2: the ZeRO checkpoint's file, copied
    <dir>/<tag>/zero_pp_rank_R_mp_rank_00_model_states.pt   stage 3: every rank's, copied
    <dir>/<tag>/zero/optimizer_state.pt         the optimizer's state that is not per element:
                                                param_groups, zero_stage, the loss scaler
                                                (stage 3: all of rank 0's state, step included)
    <dir>/<tag>/zero/<name>/fp32.pt             the whole fp32 master of parameter <name>
    <dir>/<tag>/zero/<name>/exp_avg.pt, exp_avg_sq.pt   Adam's moments, whole
    <dir>/<tag>/zero/<name>/step.pt             stages 1-2: Adam's step (a scalar tensor)

Stages 1-2 save each whole tensor as ``{"param": tensor, "cat_dim": 0}`` in the parameter's
shape; stage 3 saves the bare tensor, flat. Stages 1-2 also write ``fp32.pt`` for entries of
the module without optimizer state (buffers). A checkpoint converted from tensor- or
expert-parallel training carries slicing metadata (``vocab_tensor``, ``param_n_sub_params``,
``sub_param_shape``, ``is_expert_param``) or several ``mp_rank_XX`` files; neither is read.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from zerotron.checkpoint.deepspeed_format import (
    OSD,
    DeepSpeedCheckpoint,
    fp16_loss_scaler,
    load_deepspeed_file,
    merge_frozen_stage3,
    read_model_states,
    require_entries,
    weights_from_masters,
)
from zerotron.errors import CheckpointError

UNIVERSAL_TRACKER = "latest_universal"
OPTIMIZER_STATE = Path("zero") / "optimizer_state.pt"
MASTER, STEP = "fp32", "step"
_PLAIN_KEYS = frozenset({"param", "cat_dim"})  # what a parameter of one model-parallel rank has


def is_universal_tag(tag_dir: str | Path) -> bool:
    """Whether ``tag_dir`` holds a universal checkpoint (``zero/optimizer_state.pt``)."""
    return (Path(tag_dir) / OPTIMIZER_STATE).is_file()


def universal_tag(load_dir: str | Path, tag: str | None) -> str | None:
    """``tag``, or the one ``latest_universal`` names; None when there is no such file."""
    if tag is not None:
        return tag
    tracker = Path(load_dir) / UNIVERSAL_TRACKER
    return (tracker.read_text().strip() or None) if tracker.is_file() else None


def read_universal_checkpoint(
    tag_dir: str | Path, *, optimizer: bool = True
) -> DeepSpeedCheckpoint:
    """Read the universal checkpoint in ``tag_dir``: the fp32 masters always (the weights come
    from them, as in DeepSpeed), with ``optimizer`` also the moments and Adam's step."""
    tag_dir = Path(tag_dir)
    model = read_model_states(tag_dir)
    shared = require_entries(
        load_deepspeed_file(tag_dir / OPTIMIZER_STATE), ("param_groups",), tag_dir / OPTIMIZER_STATE
    )
    stage = int(shared.get("zero_stage", 0))
    module = dict(model["module"])
    states = {k: v for k, v in model.items() if k != "module"}
    dp = int(model.get("dp_world_size", 1) or 1)
    ckpt = DeepSpeedCheckpoint(tag_dir, stage, dp, module, states)
    ckpt.param_groups = [dict(g) for g in shared["param_groups"]]
    shapes = {n: tuple(s) for group in model["param_shapes"] for n, s in group.items()}
    keys: set[str] | None = None
    for name, shape in shapes.items():
        if "/" in name or "\\" in name or name in ("", ".", ".."):  # a folder inside zero/ only
            raise CheckpointError(
                f"parameter name {name!r} is not a folder name",
                where=str(tag_dir / "zero"),
                fix="load only checkpoints you trust",
            )
        folder = tag_dir / "zero" / name
        ckpt.masters[name] = _whole(folder / f"{MASTER}.pt", shape)
        if not optimizer:
            continue
        found = {f.stem for f in folder.glob("*.pt")} - {MASTER, STEP}
        if keys is not None and found != keys:
            raise CheckpointError(
                f"parameter {name!r} has optimizer states {sorted(found)}, the parameters "
                f"before it {sorted(keys)}",
                where=str(folder),
                fix="convert the checkpoint again with ds_to_universal.py",
            )
        keys = found
        for key in sorted(found):
            ckpt.moments.setdefault(key, {})[name] = _whole(folder / f"{key}.pt", shape)
        if (folder / f"{STEP}.pt").is_file():
            _same_step(ckpt.scalars, load_deepspeed_file(folder / f"{STEP}.pt"), folder)
    if optimizer and stage == 3:  # stage 3 keeps Adam's step in rank 0's optimizer state
        first = (shared.get(OSD) or {}).get("state", {}).get(0, {})
        if STEP in first:
            ckpt.scalars[STEP] = first[STEP]
    ckpt.loss_scaler = fp16_loss_scaler(module, shared.get("loss_scaler"))
    weights_from_masters(module, ckpt.masters)
    if stage == 3:
        merge_frozen_stage3(tag_dir, model, module, dp)
    return ckpt


def _whole(path: Path, shape: tuple[int, ...]) -> Tensor:
    """One parameter's whole fp32 tensor from its universal file, in ``shape``."""
    if not path.is_file():
        raise CheckpointError(
            "file missing: the universal checkpoint has no such state for this parameter",
            where=str(path),
            fix="convert the checkpoint again with ds_to_universal.py and copy all of zero/",
        )
    saved = load_deepspeed_file(path)
    if isinstance(saved, dict):
        sliced = sorted(set(saved) - _PLAIN_KEYS)
        if sliced:
            raise CheckpointError(
                f"the tensor carries slicing metadata {sliced}: it was converted from a "
                "tensor- or expert-parallel checkpoint",
                where=str(path),
                fix="only universal checkpoints of one model-parallel rank load",
            )
        saved = saved.get("param")
    if not isinstance(saved, Tensor) or saved.numel() != math.prod(shape):
        what = f"{saved.numel()} elements" if isinstance(saved, Tensor) else type(saved).__name__
        raise CheckpointError(
            f"the file holds {what}; the model-states file gives the parameter the shape "
            f"{list(shape)}",
            where=str(path),
            fix="the zero/ folder does not belong to this model-states file",
        )
    return saved.to(torch.float32).reshape(shape).clone()


def _same_step(scalars: dict[str, Any], step: Any, folder: Path) -> None:
    """Keep Adam's ``step``; every parameter must have the same (DeepSpeed asserts it too)."""
    if STEP not in scalars:
        scalars[STEP] = step
        return
    if not torch.equal(torch.as_tensor(scalars[STEP]), torch.as_tensor(step)):
        raise CheckpointError(
            f"Adam's step is {float(step)} here and {float(scalars[STEP])} for the parameters "
            "before it",
            where=str(folder / f"{STEP}.pt"),
            fix="convert the checkpoint again with ds_to_universal.py",
        )
